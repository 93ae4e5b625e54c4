"""``python -m minifabric`` is the ``minifabric`` command."""

from minifabric.cli import main

if __name__ == "__main__":
    main()
