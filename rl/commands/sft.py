"""`k3rl sft CONFIG [key=value …]`: supervised warm start on oracle demonstrations.

Loads the job config and runs `run_sft` (rl/orchestrator/sft.py): demonstrations of `sft.env` (default
`env.name`) trained by the RL learner with the `nll` objective, the model written to `run.output_dir/run.name/model`.
"""

from __future__ import annotations

import sys

from k3rl.rl.commands.cli import config_parser


def main(argv: list[str]) -> int:
    """`k3rl sft CONFIG [key=value …]`."""
    args = config_parser("k3rl sft", "supervised warm start on oracle demonstrations (the learner, nll objective)").parse_args(argv)
    from k3rl.rl.config import SFTJob, load_config
    from k3rl.rl.orchestrator.sft import run_sft

    run_sft(load_config(args.config, args.overrides, SFTJob))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
