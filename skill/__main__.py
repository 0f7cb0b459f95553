"""Entry point for ``python -m kvskill``."""

from kvskill.entry import main

if __name__ == "__main__":
    main()
