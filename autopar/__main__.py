"""`python -m autopar` = the `autopar` command."""

from autopar.cli import main

if __name__ == "__main__":
    main()
