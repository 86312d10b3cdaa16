"""``python -m vlmd.testing.run_with_faults MODULE [ARGS...]``: ``python -m MODULE ARGS``
with the fault-injection hook (``vlmd/testing/faults.py``) on every model it loads.

Tests start a faulty server as ``python -m vlmd.testing.run_with_faults vlmd serve ...``
with ``VLMD_FAULT_INJECTION`` set; its tensor-parallel ranks start through this module too,
so every rank poisons its model alike and the ranks stay in step. vlmd itself never
installs the hook.
"""

from __future__ import annotations

import runpy
import sys

LAUNCHER = "vlmd.testing.run_with_faults"


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(f"usage: python -m {LAUNCHER} MODULE [ARGS...]")
    # First: vlmd.cli sets environment defaults that numpy and torch read when imported.
    import vlmd.cli  # noqa: F401
    from vlmd.engine import builder, rank_launcher
    from vlmd.testing.faults import loading_with_faults

    builder.load_model = loading_with_faults(builder.load_model)
    start_rank = rank_launcher.rank_command

    def rank_command_with_faults(spec) -> list[str]:
        command = start_rank(spec)
        if command[1:2] != ["-m"]:
            raise RuntimeError(f"expected a rank command of the form PYTHON -m MODULE ..., got {command}")
        return [command[0], "-m", LAUNCHER, *command[2:]]

    rank_launcher.rank_command = rank_command_with_faults
    module, *args = argv
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
