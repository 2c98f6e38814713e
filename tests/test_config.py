"""Job configs: YAML recipes + dotted overrides checked against the typed schema."""

from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from k3rl.rl.config import ConfigError, JobConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "configs").rglob("*.yaml"))
SPLIT_RECIPES = [p for p in RECIPES if p.parent.name != "longctx"]
"""The recipes that existed when the schema was split per command (tests/fixtures/config_before/)."""


@pytest.mark.parametrize("path", RECIPES, ids=[str(p.relative_to(ROOT)) for p in RECIPES])
def test_every_recipe_loads(path):
    cfg = load_config(path)
    assert OmegaConf.get_type(cfg) is JobConfig


def test_overrides_apply_with_types():
    cfg = load_config(ROOT / "configs/rl/quickstart.yaml",
                      ["learner.lr=2e-5", "ray.address=auto", "model.linear_attn_config.kda_layers=[1,2,3]",
                       "model.num_experts=null"])
    assert cfg.learner.lr == 2e-5 and isinstance(cfg.learner.lr, float)
    assert cfg.ray.address == "auto"
    assert list(cfg.model.linear_attn_config.kda_layers) == [1, 2, 3]
    assert cfg.model.num_experts is None


def test_tilde_resets_a_key_so_a_dict_can_be_replaced():
    """Overrides merge into a recipe's dicts; `~key` first resets the key (a dict to empty), so switching
    environment on the command line does not keep the old environment's arguments."""
    recipe = ROOT / "configs/rl/quickstart.yaml"
    merged = load_config(recipe, ["env.name=search", "env.args.corpus=wiki"])
    assert "ask" in merged.env.args  # the needle's arguments are still there
    cfg = load_config(recipe, ["~env.args", "env.name=search", "env.args.corpus=wiki"])
    assert OmegaConf.to_container(cfg.env.args) == {"corpus": "wiki"}
    cfg = load_config(recipe, ["~env.args.length", "~learner.lr", "~sft.hedging_rate"])
    assert "length" not in cfg.env.args and "ask" in cfg.env.args
    assert cfg.learner.lr == load_config(None).learner.lr != merged.learner.lr and cfg.sft.hedging_rate == 0.0
    with pytest.raises(ConfigError, match="override '~rl.nope': no config key 'rl.nope' to reset"):
        load_config(recipe, ["~rl.nope"])
    with pytest.raises(ConfigError, match="not of the form ~dotted.key"):
        load_config(recipe, ["~rl..lr"])


def test_unknown_override_names_whole_key_and_valid_keys():
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/rl/quickstart.yaml", ["no.such.key=1"])
    assert "'no.such.key'" in str(e.value)
    for section in ("run", "ray", "model", "rl", "learner", "pretrain", "eval", "sft"):
        assert section in str(e.value)


def test_unknown_nested_key_lists_that_level(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("rl:\n  steps: 3\n  learning_rate: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    msg = str(e.value)
    assert "'rl.learning_rate'" in msg and "bad.yaml" in msg
    assert "steps" in msg and "group_size" in msg and "hidden_size" not in msg


@pytest.mark.parametrize("override,key,expected", [
    ("learner.lr=abc", "learner.lr", "float"),
    ("rl.steps=1.5", "rl.steps", "int"),
    ("model.linear_attn_config.num_heads=x", "model.linear_attn_config.num_heads", "int"),
    ("pretrain.stages=[{seq_len: x}]", "pretrain.stages[0].seq_len", "int"),
    ("rl.resume=maybe", "rl.resume", "bool"),
])
def test_wrong_type_names_key_value_and_type(override, key, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert f"'{key}'" in msg and f"expected {expected}" in msg


def test_section_given_a_scalar():
    with pytest.raises(ConfigError, match="'model' is a section"):
        load_config(None, ["model=3"])


@pytest.mark.parametrize("bad", ["nokey", "=3", "a..b=1", "rl.lr"])
def test_malformed_override(bad):
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config(None, [bad])


def test_base_recipes_merge_in_order(tmp_path):
    (tmp_path / "a.yaml").write_text("learner:\n  lr: 0.1\nrl:\n  steps: 5\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\nrl:\n  steps: 7\n")
    (tmp_path / "c.yaml").write_text("base: [b.yaml]\nrl:\n  group_size: 3\n")
    cfg = load_config(tmp_path / "c.yaml", ["rl.group_size=9"])
    assert (cfg.learner.lr, cfg.rl.steps, cfg.rl.group_size) == (0.1, 7, 9)


def test_base_cycle_and_missing_file(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")
    with pytest.raises(ConfigError, match="not found.*missing.yaml"):
        load_config(tmp_path / "missing.yaml")


def test_invalid_yaml_is_named(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("rl: [unclosed\n")
    with pytest.raises(ConfigError, match="broken.yaml.*not valid YAML"):
        load_config(f)
    f.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(f)


def test_interpolation_resolves():
    cfg = load_config(None, ["run.name=${algo.name}-run"])
    assert cfg.run.name == "grpo-run"


@pytest.mark.parametrize("old,new", [("rl.lr", "learner.lr"), ("rl.weight_decay", "learner.weight_decay"),
                                     ("rl.max_grad_norm", "learner.max_grad_norm"), ("rl.env", "env.name"),
                                     ("rl.algo", "algo.name"), ("rl.max_new_tokens", "rollout.max_new_tokens"),
                                     ("rl.num_rollout_workers", "rollout.num_workers"), ("rl.eval_tasks", "eval.num_tasks"),
                                     ("rl.eval_every", "eval.every"), ("rl.success_key", "env.success_key")])
def test_an_old_flat_key_names_its_new_place(tmp_path, old, new):
    with pytest.raises(ConfigError, match=f"config key '{old}' has moved to '{new}'"):
        load_config(None, [f"{old}=0.5"])
    f = tmp_path / "old.yaml"
    f.write_text(f"rl:\n  {old.split('.')[1]}: 0.5\n")
    with pytest.raises(ConfigError, match=f"old.yaml: config key '{old}' has moved to '{new}'"):
        load_config(f)
    with pytest.raises(ConfigError, match=f"has moved to '{new}'"):
        load_config(None, [f"~{old}"])


def test_every_learner_setting_reaches_the_learner_config():
    """`LearnerConfig.from_job` takes every field of the `learner:` section (none is dropped on the way)."""
    import dataclasses

    from k3rl.rl.config import LearnerSettings
    from k3rl.rl.train.learner import LearnerConfig

    values = {"optimizer": "muon", "dtype": "bfloat16", "micro_batch_tokens": 123, "recompute": "selective",
              "routing_replay": False, "ref_model_path": "/ref", "lr": 0.25, "weight_decay": 0.5, "max_grad_norm": 3.0,
              "adam_beta1": 0.8, "adam_beta2": 0.9, "adam_eps": 1e-6, "muon_momentum": 0.9, "logprob_chunk_size": 7,
              "compute_entropy": True, "lr_scheduler": "cosine", "warmup_steps": 4, "total_steps": 40,
              "micro_batch_seqs": 2, "segment_tokens": 4096, "share_prefix": False, "decay_steps": 5,
              "min_lr_ratio": 0.1, "expert_parallel": 1, "fsdp": False}
    lora = {"rank": 8, "alpha": 4.0, "dropout": 0.25, "push": "merged", "targets": ["q_proj", "w1"]}
    assert set(values) | {"lora"} == {f.name for f in dataclasses.fields(LearnerSettings)}
    job = load_config(None, [f"learner.{k}={v}" for k, v in values.items()] + ["algo.name=ppo", "run.seed=5"]
                      + [f"learner.lora.{k}={v}".replace("'", "") for k, v in lora.items()])
    cfg = LearnerConfig.from_job(job, "/policy")
    assert {k: getattr(cfg, k) for k in values} == values
    assert dataclasses.asdict(cfg.lora) == lora  # a plain dataclass, as Ray ships it
    assert (cfg.model_path, cfg.algo, cfg.seed) == ("/policy", "ppo", 5)
    # the sharded learner's keys (refused with Muon and segments above, so set on their own)
    job = load_config(None, ["learner.expert_parallel=2", "learner.fsdp=true", "learner.share_prefix=false",
                             "learner.num_ranks=2", "algo.args.kl_coef=0"])
    cfg = LearnerConfig.from_job(job, "/policy")
    assert (cfg.expert_parallel, cfg.fsdp, cfg.sharded) == (2, True, True)
    # a decaying schedule without learner.total_steps decays over the job's steps
    job = load_config(None, ["learner.lr_scheduler=linear", "rl.steps=17"])
    assert LearnerConfig.from_job(job, "/policy").total_steps == 17


def test_every_old_recipe_key_has_a_new_place_in_the_schema():
    from omegaconf import OmegaConf

    from k3rl.rl.config import MOVED_KEYS, JobConfig

    defaults = OmegaConf.structured(JobConfig)
    for old, new in MOVED_KEYS.items():
        old, new = old.replace("[i]", "[0]"), new.replace("[i]", "[0]")
        assert OmegaConf.select(defaults, old, default="gone") == "gone", old
        assert OmegaConf.select(defaults, new, default="gone") != "gone", new


def test_an_old_nested_section_in_a_recipe_names_its_new_place(tmp_path):
    f = tmp_path / "old.yaml"
    f.write_text("rl:\n  steps: 3\n  env_args:\n    length: 100\n")
    with pytest.raises(ConfigError, match="old.yaml: config key 'rl.env_args' has moved to 'env.args'"):
        load_config(f)


@pytest.mark.parametrize("key,value,valid", [("rl.mode", "fast", "sync, async"),
                                             ("rollout.engine", "sglang", "torch, vllm"),
                                             ("learner.optimizer", "sgd", "adamw, muon"),
                                             ("learner.dtype", "int8", "float32, bfloat16, float16, float64"),
                                             ("env.bad_task_rows", "ignore", "refuse, skip")])
def test_choices_are_enums_checked_at_load(key, value, valid):
    with pytest.raises(ConfigError, match=f"config key '{key}' got '{value}' \\(str\\), expected one of {valid}"):
        load_config(None, [f"{key}={value}"])


def test_enum_choices_read_and_ship_as_plain_strings(tmp_path):
    """Members compare and print as their strings; the learner config Ray ships holds plain str."""
    from k3rl.rl.config import to_yaml
    from k3rl.rl.train.learner import LearnerConfig

    cfg = load_config(None, ["rl.mode=async", "learner.optimizer=muon", "learner.dtype=bfloat16"])
    assert cfg.rl.mode == "async" and f"{cfg.rl.mode}" == "async"
    assert "mode: async" in to_yaml(cfg) and "optimizer: muon" in to_yaml(cfg)
    lc = LearnerConfig.from_job(cfg, tmp_path)
    assert type(lc.optimizer) is str and lc.optimizer == "muon" and type(lc.dtype) is str and lc.dtype == "bfloat16"


@pytest.mark.parametrize("old,new", [("rl.num_learners", "learner.num_ranks"), ("rl.learner_num_cpus", "learner.num_cpus"),
                                     ("rl.learner_num_gpus", "learner.num_gpus"), ("pretrain.num_learners", "learner.num_ranks"),
                                     ("sft.lr", "sft.learner.lr"), ("sft.lr_scheduler", "sft.learner.lr_scheduler"),
                                     ("sft.logprob_chunk_size", "sft.learner.logprob_chunk_size"),
                                     ("pretrain.weight_decay", "pretrain.learner.weight_decay"),
                                     ("eval.tasks_file", "eval.tasks_path")])
def test_a_key_of_the_one_schema_names_its_new_place(tmp_path, old, new):
    with pytest.raises(ConfigError, match=f"override '{old}=2': config key '{old}' has moved to '{new}'"):
        load_config(ROOT / "configs/rl/quickstart.yaml", [f"{old}=2"])
    section, key = old.split(".")
    (tmp_path / "old.yaml").write_text(f"{section}:\n  {key}: 2\n")
    with pytest.raises(ConfigError, match=f"old.yaml: config key '{old}' has moved to '{new}'"):
        load_config(tmp_path / "old.yaml")


def test_a_stage_key_names_its_new_place_with_its_index(tmp_path):
    (tmp_path / "old.yaml").write_text("pretrain:\n  stages:\n    - {seq_len: 256}\n    - {seq_len: 512, schedule: cosine}\n")
    with pytest.raises(ConfigError, match=r"config key 'pretrain.stages\[1\].schedule' has moved to "
                                          r"'pretrain.stages\[1\].learner.lr_scheduler'"):
        load_config(tmp_path / "old.yaml")


def test_each_command_keeps_its_own_sections():
    """A recipe serves several commands: it is checked whole, and each command's schema keeps its sections."""
    from k3rl.rl.config import EvalJob, PretrainJob, QuickstartJob, SFTJob, TrainJob

    recipe = ROOT / "configs/rl/quickstart.yaml"
    whole = load_config(recipe)
    for schema, absent in [(TrainJob, {"sft", "pretrain"}), (SFTJob, {"rl", "pretrain"}), (QuickstartJob, {"pretrain"}),
                           (PretrainJob, {"rl", "sft"}), (EvalJob, {"rl", "sft", "pretrain", "learner", "algo"})]:
        cfg = load_config(recipe, schema=schema)
        assert OmegaConf.get_type(cfg) is schema and not absent & set(cfg)
        for name in cfg:
            assert OmegaConf.to_container(cfg[name], resolve=True) == OmegaConf.to_container(whole[name], resolve=True)
    assert load_config(recipe, schema=TrainJob).learner.num_cpus == 2.0
    with pytest.raises(ConfigError, match="unknown config key 'sft.nope'"):
        load_config(recipe, ["sft.nope=1"], schema=TrainJob)


def test_sft_and_stages_override_the_learner_section():
    """`sft.learner` and `pretrain.stages[i].learner` set what they name; a null field leaves `learner:`'s value."""
    from k3rl.rl.config import learner_overrides

    cfg = load_config(ROOT / "configs/rl/quickstart.yaml", ["learner.weight_decay=0.3", "sft.learner.max_grad_norm=2"])
    assert learner_overrides(cfg.sft.learner) == {"lr": 3e-3, "lr_scheduler": "cosine", "warmup_steps": 10,
                                                  "weight_decay": 0.0, "max_grad_norm": 2.0,
                                                  "recompute": "none", "logprob_chunk_size": 1024}
    cfg = load_config(ROOT / "configs/pretrain/cpu.yaml")
    assert learner_overrides(cfg.pretrain.learner, cfg.pretrain.stages[2].learner) == {
        "weight_decay": 0.1, "max_grad_norm": 1.0, "lr": 1.5e-3, "lr_scheduler": "cosine", "warmup_steps": 1, "min_lr_ratio": 0.1,
        "segment_tokens": 2048}


CHECKED = [
    ("TrainJob", "rl", ["learner.num_ranks=0"], "learner.num_ranks: must be ≥ 1, got 0"),
    ("TrainJob", "rl", ["rl.steps=0"], "rl.steps: must be ≥ 1, got 0"),
    ("TrainJob", "rl", ["rollout.num_workers=0"], "rollout.num_workers: must be ≥ 1, got 0"),
    ("TrainJob", "rl", ["rl.keep_checkpoints=0"], "rl.keep_checkpoints: must be ≥ 1, got 0"),
    ("TrainJob", "rl", ["rl.save_every=-1"], "rl.save_every: must be ≥ 0, got -1"),
    ("TrainJob", "rl", ["eval.every=-1"], "eval.every: must be ≥ 0, got -1"),
    ("TrainJob", "rl", ["rollout.partial_rounds=-1"], "rollout.partial_rounds: must be ≥ 0, got -1"),
    ("TrainJob", "rl", ["run.device=cuda"], "run.device=cuda: set learner.num_gpus and rollout.num_gpus"),
    ("TrainJob", "rl", ["learner.num_ranks=3", "learner.expert_parallel=2"],
     r"learner.expert_parallel: 2 must divide the number of learner ranks \(learner.num_ranks = 3\)"),
    ("TrainJob", "rl", ["learner.micro_batch_seqs=0"], "learner.micro_batch_seqs: must be ≥ 1 or null, got 0"),
    ("TrainJob", "rl", ["learner.lr_scheduler=wsd", "learner.decay_steps=30"],
     "learner.wsd: warmup_steps 0 \\+ decay_steps 30 must fit in total_steps 8"),
    ("TrainJob", "rl", ["learner.expert_parallel=2", "learner.num_ranks=2", "learner.share_prefix=false"],
     "learner.expert_parallel / fsdp .* a reference model"),
    ("SFTJob", "sft", ["sft.grad_accum=0"], "sft.grad_accum: must be > 0, got 0"),
    ("SFTJob", "sft", ["sft.learner.logprob_chunk_size=0"], "sft.learner.logprob_chunk_size: must be > 0, got 0"),
    ("SFTJob", "sft", ["sft.learner.lr_scheduler=constant"], "sft.learner.warmup_steps: 10 with sft.learner.lr_scheduler=constant"),
    ("SFTJob", "sft", ["sft.hedging_rate=1.5"], r"sft.hedging_rate: must be in \[0, 1\), got 1.5"),
    ("SFTJob", "sft", ["sft.closed_book_rate=0.5"], r"sft.closed_book_rate \+ sft.hedging_rate: must be < 1"),
    ("SFTJob", "sft", ["sft.hedge=' '"], "sft.hedge: empty"),
    ("SFTJob", "sft", ["sft.eval_tasks=-1"], "sft.eval_tasks: must be ≥ 0, got -1"),
    ("SFTJob", "sft", ["run.device=tpu"], "run.device: `cpu` or `cuda`, got 'tpu'"),
    ("QuickstartJob", "rl", ["rl.group_size=0"], "rl.group_size: must be ≥ 1, got 0"),
    ("QuickstartJob", "rl", ["sft.num_tasks=0"], "sft.num_tasks: must be > 0, got 0"),
    ("PretrainJob", "pretrain", ["learner.num_ranks=3"],
     r"pretrain.stages\[0\].batch_tokens: 32 rows per step do not split evenly over learner.num_ranks = 3 ranks"),
    ("PretrainJob", "pretrain", ["pretrain.save_every=0"], "pretrain.save_every: must be ≥ 1, got 0"),
    ("PretrainJob", "pretrain", ["pretrain.heldout_docs=-1"], "pretrain.heldout_docs / heldout_every: must be ≥ 0"),
    ("PretrainJob", "pretrain", ["pretrain.eval_lengths=[100]"], r"pretrain.eval_lengths: each ≥ 256 tokens, got \[100\]"),
    ("PretrainJob", "pretrain", ["pretrain.stages=[]"], "pretrain.stages: empty"),
    ("PretrainJob", "pretrain", ["pretrain.stages=[{seq_len: 512}, {seq_len: 256}]"],
     r"pretrain.stages\[1\].seq_len: 256 is not longer than stage 0's 512"),
    ("PretrainJob", "pretrain", ["pretrain.stages=[{tokens: 0}]"], r"pretrain.stages\[0\].tokens: must be > 0, got 0"),
    ("PretrainJob", "pretrain", ["pretrain.stages=[{batch_tokens: 100}]"],
     r"pretrain.stages\[0\].batch_tokens: must be a positive multiple of seq_len 8192"),
    ("PretrainJob", "pretrain", ["pretrain.stages=[{learner: {lr: 0}}]"], r"pretrain.stages\[0\].learner.lr: must be > 0"),
    ("PretrainJob", "pretrain", ["pretrain.stages=[{decay_fraction: 2}]"], r"pretrain.stages\[0\].decay_fraction: must be in"),
    ("PretrainJob", "pretrain", ["pretrain.stages=[{learner: {min_lr_ratio: 2}}]"],
     r"pretrain.stages\[0\].learner.min_lr_ratio: must be in \[0, 1\]"),
    ("PretrainJob", "pretrain", ["pretrain.stages=[{tokens: 65536, batch_tokens: 8192, learner: {warmup_steps: 8}}]"],
     r"pretrain.stages\[0\].learner.warmup_steps: 8 warmup \+ 2 decay steps do not fit in the stage's 8 steps"),
    ("PretrainJob", "pretrain", ["pretrain.stages=[{learner: {segment_tokens: 0}}]"],
     r"pretrain.stages\[0\].learner.segment_tokens: must be ≥ 1 or null, got 0"),
    ("PretrainJob", "pretrain", ["pretrain.stages=[{rope_theta: 1}]"], r"pretrain.stages\[0\].rope_theta: must be > 1"),
    ("PretrainJob", "pretrain", ["pretrain.stages=[{mixture: {wiki: -1}}]"], r"pretrain.stages\[0\].mixture: weights must be ≥ 0"),
    ("EvalJob", "eval", ["eval.context_lengths=[100]"], r"eval.context_lengths: each ≥ 256 tokens, got \[100\]"),
    ("EvalJob", "eval", ["eval.num_tasks=0"], "eval.num_tasks: must be ≥ 1, got 0"),
    ("EvalJob", "eval", ["eval.effective_ratio=0"], r"eval.effective_ratio: in \(0, 1\], got 0"),
    ("EvalJob", "eval", ["eval.endpoint=http://x/v1", "eval.endpoint_retries=-1"], "eval.endpoint_retries ≥ 0"),
    ("EvalJob", "eval", ["eval.endpoint=http://x/v1", "eval.endpoint_task_timeout_s=0"], "eval.endpoint_task_timeout_s: must be > 0"),
    ("EvalJob", "eval", ["eval.endpoint=http://x/v1", "eval.endpoint_max_reply_chars=0"], "eval.endpoint_max_reply_chars: must be ≥ 1"),
]
RECIPE = {"rl": "configs/rl/quickstart.yaml", "sft": "configs/rl/sft.yaml", "pretrain": "configs/pretrain/cpu.yaml",
          "eval": "configs/eval/longctx.yaml"}


@pytest.mark.parametrize("schema,recipe,overrides,message", CHECKED, ids=[f"{c[0]}:{c[2][-1]}" for c in CHECKED])
def test_a_command_schema_checks_values_naming_the_key(schema, recipe, overrides, message):
    """Value and cross-field checks live in the command's schema (rl/config/checks.py): the loader names the key."""
    import k3rl.rl.config as config

    load_config(ROOT / RECIPE[recipe], [], getattr(config, schema))
    with pytest.raises(ConfigError, match=message):
        load_config(ROOT / RECIPE[recipe], overrides, getattr(config, schema))
    load_config(ROOT / RECIPE[recipe], overrides)  # a recipe seen whole (`k3rl config`) is each command's to check


def _leaves(data, path=""):
    if isinstance(data, dict):
        return {k: v for key, value in data.items() for k, v in _leaves(value, f"{path}.{key}" if path else key).items()}
    if isinstance(data, list) and data and isinstance(data[0], dict):
        return {k: v for i, value in enumerate(data) for k, v in _leaves(value, f"{path}[{i}]").items()}
    return {path: data}


@pytest.mark.parametrize("path", SPLIT_RECIPES, ids=[str(p.relative_to(ROOT)) for p in SPLIT_RECIPES])
def test_k3rl_config_prints_the_values_it_printed_before_apart_from_moved_keys(path):
    """tests/fixtures/config_before/ holds `k3rl config` of each recipe before the schema was split per command.
    Every value is the same, at its new place for a moved key; the only keys added are the learner's ranks and
    resources (`learner.num_ranks`, …) and a stage's `learner.segment_tokens` (null before and after)."""
    import yaml

    from k3rl.rl.config import MOVED_KEYS, to_yaml
    from k3rl.util.yaml_config import moved_to

    name = "_".join(path.relative_to(ROOT / "configs").with_suffix("").parts)
    before = _leaves(yaml.safe_load((ROOT / "tests/fixtures/config_before" / f"{name}.yaml").read_text()))
    after = _leaves(yaml.safe_load(to_yaml(load_config(path))))
    targets = set()
    for key, value in before.items():
        new = moved_to(key, MOVED_KEYS) or key
        if key.endswith("gradient_checkpointing"):  # the boolean became `recompute: none|full|selective`
            value = "full" if value else "none"
        targets.add(new)
        assert new in after, key
        assert after[new] == value, (key, new, value, after[new])
    assert set(after) == targets


def test_every_key_the_docs_name_resolves():
    """Each dotted key README.md, docs/ and envs/README.md write (`learner.num_ranks`, `eval.tasks_path=…`) is a key
    of the schema (an entry of a free-form dict such as `env.args.length` counts when the dict is), or an old key
    whose move is named."""
    import re

    from k3rl.rl.config import MOVED_KEYS

    sections = "run|ray|model|rl|algo|rollout|env|learner|pretrain|eval|sft"
    pattern = re.compile(rf"(?<![\w./-])((?:{sections})(?:\.[a-z_]+|\[[0-9i]\])+)(?=[=`\s,:)])")
    defaults = OmegaConf.structured(JobConfig)
    texts = [ROOT / "README.md", ROOT / "envs/README.md", *sorted(set((ROOT / "docs").glob("*.md")) - {ROOT / "docs/model_spec.md"})]
    missing = []
    for path in texts:
        for key in set(pattern.findall(path.read_text())):
            if key.rsplit(".", 1)[-1] in ("py", "json", "jsonl", "yaml", "md", "png", "pt"):
                continue
            here = key.replace("[i]", "[0]")
            parent = here.rsplit(".", 1)[0]
            if OmegaConf.select(defaults, here, default="gone") != "gone":
                continue
            if key in MOVED_KEYS and f"'{key}' has moved" in path.read_text():
                continue
            node = OmegaConf.select(defaults, parent, default=None)
            if isinstance(node, DictConfig) and OmegaConf.get_type(node) is dict:
                continue
            try:  # a field of an optional section that is null by default (`sft.learner.lora.rank`): an override sets it
                OmegaConf.merge(defaults, OmegaConf.from_dotlist([f"{here}=0"]))
                if OmegaConf.select(defaults, parent, default="gone") is None:
                    continue
            except Exception:  # noqa: BLE001 — any refusal means the key is not the schema's
                pass
            missing.append(f"{path.name}: {key}")
    assert not missing, missing
