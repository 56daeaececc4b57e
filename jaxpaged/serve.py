"""`python -m jaxpaged.serve`: the server's command line lives in jaxpaged/entrypoints/serve.py."""

from jaxpaged.entrypoints.serve import main

if __name__ == "__main__":
    raise SystemExit(main())
