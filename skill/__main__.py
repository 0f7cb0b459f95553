"""Entry point for ``python -m kvskill``."""

from kvskill.cli import main

if __name__ == "__main__":
    main()
