"""What the `ringlm batch` benchmarks (batch_throughput.py, segment_cache.py) share: their common
options and the command line of one run."""
import os


def add_batch_args(ap):
    """The options every batch benchmark takes: the binary, the model, threads and rounds."""
    ap.add_argument("--binary", default="build/bin/ringlm")
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--rounds", type=int, default=3)


def batch_command(args, inputs, out, parallel, *extra):
    """`ringlm batch` over `inputs` into `out` (removed first: each run writes a fresh file)."""
    if os.path.exists(out):
        os.remove(out)
    cmd = [args.binary, "batch", "-i", inputs, "-o", out, "--parallel", str(parallel), "-t", str(args.threads),
           *extra]
    if args.model:
        cmd += ["-m", args.model]
    return cmd
