"""Provision the models troupe serves and trains, once, into the model cache.

Tiny CPU (tests use `tiny`; the CPU default run uses SmolLM2, ~1 min the first time):
    python scripts/provision_models.py tiny smollm2-135m
Cluster: run the same command on a node that shares the cache (set TROUPE_CACHE), before
submitting the job, so every engine and learner finds the folders ready.

With no names it provisions every registered model. Re-runs return at once.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.models import MODELS, provision  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"any of {sorted(MODELS)} (default: all)")
    args = parser.parse_args()
    unknown = [name for name in args.names if name not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for name in args.names or sorted(MODELS):
        print(f"{name}: {provision(name)}")


if __name__ == "__main__":
    main()
