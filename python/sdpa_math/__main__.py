"""`python -m sdpa_math [COMMAND] [ARGS]`: demo (the default), bench, probe, info, explain."""
import sys

USAGE = """usage: python -m sdpa_math [COMMAND] [ARGS...]

commands:
  demo    a tiny model learns an induction head; its maps before and after, to a PNG (the default)
  bench   the side-by-side benchmark (run), the statistics rows (stats) and the performance gate (gate)
  probe   re-check the contract's observed lines against the installed PyTorch
  info    what this build contains: versions, devices, kernels
  explain which kernels run a problem (forward, backward, statistics) and why the others decline

`python -m sdpa_math COMMAND --help` for a command's own arguments."""


def info(argv):
    """Prints the package and PyTorch versions, and which backends this build registered."""
    import torch

    import sdpa_math

    from ._ops import build_info

    has_cuda = torch.ops.sdpa_math.built_with_cuda()
    built = build_info()
    print(f"sdpa_math {sdpa_math.__version__} from {sdpa_math.__file__}")
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}); built for torch {built.get('TORCH_VERSION', '?')}")
    if has_cuda:
        print(f"CUDA toolkit {built.get('CUDA_TOOLKIT', '?')}, architectures {built.get('CUDA_ARCHITECTURES', '?')}")
    print(f"CPU kernels: {sdpa_math.cpu_isa()} (this build and CPU have: {', '.join(sdpa_math.cpu_isas_available())}); "
          f"CUDA kernels: {'yes' if has_cuda else 'no (built without nvcc)'}")
    if has_cuda and torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cc = torch.cuda.get_device_capability(i)
            path = "Hopper wgmma/TMA kernels" if cc == (9, 0) else "mma.sync kernels"
            print(f"cuda:{i} {torch.cuda.get_device_name(i)} sm_{cc[0]}{cc[1]}: {path}")
    return 0


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command = argv.pop(0) if argv and not argv[0].startswith("-") else "demo"
    if command == "demo":
        from .demo import main as run
    elif command == "bench":
        from .bench import main as run
    elif command == "probe":
        from .probe import main as run
    elif command == "info":
        run = info
    elif command == "explain":
        from .explain import main as run
    else:
        print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
