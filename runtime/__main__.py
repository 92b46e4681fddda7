"""``python -m rlc.runtime [--probe] runtime.yaml``: run GRPO (or the environment probe) for a bundle.

Without ``--probe`` this is the training job's entry point (``rlc.runtime.driver.main``); with it, the
bundle's pre-flight probe (``rlc.runtime.probe.main``). Heavy imports happen inside.
"""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlc.runtime", description=__doc__.split("\n")[0])
    parser.add_argument("runtime_yaml", help="the bundle's resolved runtime.yaml")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides of runtime.yaml for this start only, e.g. grpo.max_steps=10")
    parser.add_argument("--probe", action="store_true", help="check the environment instead of training")
    args = parser.parse_args(argv)
    if args.probe:
        from rlc.runtime.probe import main as probe_main  # noqa: PLC0415

        return int(probe_main(args.runtime_yaml) or 0)
    from rlc.runtime.driver import main as driver_main  # noqa: PLC0415

    return int(driver_main(args.runtime_yaml, args.overrides))


if __name__ == "__main__":
    sys.exit(main())
