"""The update stage: a rollout batch and its advantages become a token batch
(:mod:`~gigrl.update.batch`), a loss (:mod:`~gigrl.update.loss`: PPO-clip, KL, SFT
cross-entropy) and an optimizer step (:mod:`~gigrl.update.step`: jitted, sharded, donated)."""
