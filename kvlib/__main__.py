"""``python -m kvlib`` — the command line (see :mod:`kvlib.cli`)."""

from kvlib.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
