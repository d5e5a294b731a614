set -e
cd /work/main
for pack in true false; do
  rm -rf /tmp/pk_$pack
  .venv/bin/python -m gigrl.cli.train --config configs/countries.py:smollm2-135m --workdir /tmp/pk_$pack \
    --config.train.init_from=runs/countries_smollm2/sft --config.train.num_steps=5 \
    --config.train.eval_questions=0 --config.checkpoint.every_steps=1000 \
    --config.train.compile_cache=/tmp/pk_cache --config.train.pack_update_rows=$pack > /tmp/pk_$pack.log 2>&1
done
