"""`anytime build`: checkpoint -> ONNX graphs -> engines -> profiles -> ladder.json (engines/build.py does the work).

The options live beside the code they configure (engines.build.add_build_arguments); importing this module
imports no framework: `anytime serve` and `--help` stay fast.
"""

from __future__ import annotations

import argparse


def add_build(p: argparse.ArgumentParser) -> None:
    from engines.build import add_build_arguments

    add_build_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from engines.build import run_build

    run_build(args)
