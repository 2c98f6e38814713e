"""Keys of earlier recipes and where they live now: a recipe or override that still uses one is told where it went."""

MOVED_KEYS = {
    "rl.lr": "learner.lr", "rl.weight_decay": "learner.weight_decay", "rl.max_grad_norm": "learner.max_grad_norm",
    "rl.algo": "algo.name", "rl.algo_args": "algo.args",
    "rl.engine": "rollout.engine", "rl.temperature": "rollout.temperature", "rl.top_p": "rollout.top_p",
    "rl.max_new_tokens": "rollout.max_new_tokens", "rl.max_turns": "rollout.max_turns",
    "rl.max_context_tokens": "rollout.max_context_tokens", "rl.num_rollout_workers": "rollout.num_workers",
    "rl.rollout_num_cpus": "rollout.num_cpus", "rl.rollout_num_gpus": "rollout.num_gpus",
    "rl.max_worker_restarts": "rollout.max_restarts",
    "rl.env": "env.name", "rl.env_args": "env.args", "rl.tasks_path": "env.tasks_path",
    "rl.num_tasks": "env.num_tasks", "rl.bad_task_rows": "env.bad_task_rows", "rl.success_key": "env.success_key",
    "rl.eval_every": "eval.every", "rl.eval_tasks_path": "eval.tasks_path", "rl.eval_tasks": "eval.num_tasks",
    "rl.eval_seed": "eval.seed", "rl.eval_temperature": "eval.temperature", "eval.tasks": "eval.families",
    "eval.tasks_file": "eval.tasks_path",
    "rl.num_learners": "learner.num_ranks", "rl.learner_num_cpus": "learner.num_cpus",
    "rl.learner_num_gpus": "learner.num_gpus", "pretrain.num_learners": "learner.num_ranks",
    **{f"sft.{key}": f"sft.learner.{key}" for key in ("lr", "lr_scheduler", "warmup_steps", "weight_decay", "max_grad_norm",
                                                      "logprob_chunk_size")},
    "sft.gradient_checkpointing": "sft.learner.recompute", "sft.learner.gradient_checkpointing": "sft.learner.recompute",
    "learner.gradient_checkpointing": "learner.recompute",
    "pretrain.weight_decay": "pretrain.learner.weight_decay", "pretrain.max_grad_norm": "pretrain.learner.max_grad_norm",
    **{f"pretrain.stages[i].{key}": f"pretrain.stages[i].learner.{key}"
       for key in ("lr", "warmup_steps", "min_lr_ratio", "segment_tokens")},
    "pretrain.stages[i].schedule": "pretrain.stages[i].learner.lr_scheduler",
}
"""Keys of earlier recipes and where they live now: using one is an error that names the new place (`[i]`: any
item of a list)."""
