"""``python -m fleetmpi.docs regenerate`` / ``python -m fleetmpi.docs --check``."""
import argparse
import sys

from . import regenerate, stale


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m fleetmpi.docs",
                                     description="write or check the generated files")
    parser.add_argument("action", nargs="?", choices=["regenerate"],
                        help="rewrite every generated file")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when a committed file differs from what renders today")
    args = parser.parse_args(argv)
    if args.check == (args.action is not None):
        parser.error("give either regenerate or --check")
    if args.check:
        out_of_date = stale()
        for path in out_of_date:
            print(f"{path} is out of date: run python -m fleetmpi.docs regenerate")
        if not out_of_date:
            print("every generated file is up to date")
        return 1 if out_of_date else 0
    for path in regenerate():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
