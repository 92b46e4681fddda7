"""``python -m rlc.runtime [--probe] runtime.yaml``: run GRPO (or the environment probe) for a bundle.

Without ``--probe`` this is the training job's entry point (``rlc.runtime.driver.main``); with it, the
bundle's pre-flight probe (``rlc.runtime.probe.main``). Heavy imports happen inside.

Exit codes, as rlc's own commands: 0 ok, 1 ``runtime.yaml`` (or an override) refused, or a probe check
failed, 2 usage or I/O errors (the file cannot be read), 3 a bug in rlc; and when a run stops: 4 a
worker failed, 5 gen-KL above ``grpo.max_gen_kl``, 6 another failure (named in the run's last lines), 143 a
SIGTERM (``scancel``, the job's time limit), 130 Ctrl-C.
"""
from __future__ import annotations

import argparse
import sys
import traceback

from rlc.contract.runtime_config import RuntimeConfigError
from rlc.runtime.driver import main as driver_main
from rlc.runtime.probe import main as probe_main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlc.runtime", description=__doc__.split("\n")[0],
                                     epilog="exit codes: 0 ok, 1 runtime.yaml refused, 2 usage or I/O errors, "
                                            "3 a bug in rlc, 4 a worker failed, 5 gen-KL too high, 6 the run failed, "
                                            "143 stopped by SIGTERM, 130 Ctrl-C")
    parser.add_argument("runtime_yaml", help="the bundle's resolved runtime.yaml")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides of runtime.yaml for this start only, e.g. grpo.max_steps=10")
    parser.add_argument("--probe", action="store_true", help="check the environment instead of training")
    args = parser.parse_args(argv)  # a usage error exits 2 (argparse)

    try:
        if args.probe:
            return int(probe_main(args.runtime_yaml) or 0)
        return int(driver_main(args.runtime_yaml, args.overrides))
    except RuntimeConfigError as exc:
        print(f"rlc.runtime: {args.runtime_yaml}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the file (or the output) cannot be read or written
        print(f"rlc.runtime: cannot read {args.runtime_yaml}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"rlc.runtime: this Python cannot import {exc.name or exc}: the runtime needs torch, ray, vllm and "
              "megatron (run it inside the bundle's container)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug in rlc: the run's own failures are reported (and coded) by the driver  # noqa: BLE001
        traceback.print_exc()
        print(f"rlc.runtime: internal error: {type(exc).__name__}: {exc}\nThis is a bug in rlc; report it with "
              "the traceback above.", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
