#!/usr/bin/env bash
# docs/results.md §2.8, DGPO's group scores: an exploratory run after the comparison, logging s_g and the spread of
# the group weights. The dgpo arm of experiments/optimizers.toml (its [task] and arm overrides, as `tpflow sweep`
# passes them) at seed 37, with old_decay_unit = "step", what that arm ran before the option existed. Run at commit
# 13fdcae on 2 shared CPU cores; its metrics.jsonl is beside this file.
set -euo pipefail
OMP_NUM_THREADS=1 tpflow train recipes/shapes_flowgrpo.toml --run-dir runs/dgpo_group_scores/seed_37 \
  --set reward.name='"shapes-geneval"' --set reward.score='"soft"' --set dataset.test_prompts='"distinct"' \
  --set dataset.test_min_per_tag=24 --set eval.images_per_prompt=4 --set eval.num_prompts=1000000 \
  --set eval.batch_size=195 --set eval.seed=12345 --set eval.at_start=true --set eval.every=8 \
  --set train.ema=false --set train.epochs=16 --set train.prompts_per_epoch=8 --set train.rollout_batch=64 \
  --set train.save_every=8 \
  --set 'optimizer={"name" = "dgpo", "learning_rate" = 0.003, "kl_weight" = 0.0, "num_timesteps" = 10, "train_timesteps" = 4, "trunc_steps" = 4, "micro_batch_size" = 8, "gradient_accumulation_steps" = 1, "old_decay_unit" = "step"}' \
  --set credit.name='"outcome"' --set rollout.noise_level=0.0 --set rollout.window_size=1 \
  --set 'rollout.window_range=[0, 1]' --set rollout.guidance=3.0 --set train.seed=37
