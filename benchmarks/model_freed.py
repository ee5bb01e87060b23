"""Resident memory a training script keeps after ``autoparallelize`` once it drops its model.

    PYTHONPATH=. python benchmarks/model_freed.py
    PYTHONPATH=. python benchmarks/model_freed.py --n-embd 768 --layers 12

One process, one gloo rank (``Mesh.from_world((1,))``, the ``ddp`` recipe): a GPT built in a
function, handed to ``autoparallelize``, the function returns only the parallel module; then
``gc.collect()``. Prints the parameters' bytes, the resident memory added since before the model
was built (``VmRSS``), and whether the original module is still alive (a weak reference).
Until session 22 the first solve in a process kept every frame running at pulp's first import,
so ``autoparallelize``'s frames and the user's unsharded model stayed resident (the test:
``tests/unit/test_caller_frames.py``). Run it in a fresh process: the figure is about the first
plan of a process.
"""

from __future__ import annotations

import argparse
import gc
import socket
import sys
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def resident_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    import autopar
    from autopar.models import GPT, GPTConfig

    def user_code() -> tuple[object, weakref.ref, int]:
        torch.manual_seed(0)
        config = GPTConfig(
            vocab_size=args.vocab, n_layer=args.layers, n_embd=args.n_embd, n_head=8, block_size=64
        )
        model = GPT(config)
        numel = sum(p.numel() for p in model.parameters())
        idx = torch.randint(0, args.vocab, (4, 64))
        mesh = autopar.Mesh.from_world((1,))
        pmodel = autopar.autoparallelize(model, mesh, (idx, idx), recipe="ddp")
        return pmodel, weakref.ref(model), numel

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.set_num_threads(1)
    start = resident_mib()
    pmodel, model_ref, numel = user_code()
    gc.collect()
    added = resident_mib() - start
    print(
        f"parameters {numel / 1e6:.1f} M ({numel * 4 / 2**20:.0f} MiB fp32); resident memory "
        f"added, model dropped: {added:.0f} MiB; original module alive: {model_ref() is not None}"
    )
    del pmodel
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
