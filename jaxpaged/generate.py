"""`python -m jaxpaged.generate`: the command line lives in jaxpaged/entrypoints/generate.py."""

from jaxpaged.entrypoints.generate import main

if __name__ == "__main__":
    raise SystemExit(main())
