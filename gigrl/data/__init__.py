"""Data stage: QA sets, corpus, tokenizer and the query pool."""
