"""`python -m sdpa_math COMMAND`: demo (the default), bench, probe."""
import sys


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and not argv[0].startswith("-") else "demo"
    if command == "demo":
        from .demo import main as run
    elif command == "bench":
        from .bench import main as run
    elif command == "probe":
        from .probe import main as run
    else:
        print(f"unknown command {command!r}; use demo, bench or probe", file=sys.stderr)
        return 2
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
