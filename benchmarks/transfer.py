"""NIXL READ bandwidth between two processes: raw (one descriptor) against kvturn's block reads.

    python benchmarks/transfer.py [--sizes-mib 1,16,128] [--out results/transfer.json]

A second process registers a KV pool (the tiny model's layout) and a raw buffer; this process
reads from them over NIXL (UCX, loopback). Block reads are timed both for consecutive blocks
(one run: one descriptor per layer and key/value) and for scattered blocks (those descriptors for
every block), as a long-lived decode worker's pool fragments.
"""
import argparse

from rich.console import Console
from rich.table import Table

from kvturn.bench.machine import machine, write_json
from kvturn.model.make_model import default_model_dir
from kvturn.bench.nixl_read import ReadBench, median_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", default="1,16,128")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="results/transfer.json")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    rows = []
    with ReadBench(default_model_dir("tiny"), 2 * max(sizes) + 4) as bench:
        for size in sizes:
            nbytes = size * 2**20
            blocks = nbytes // bench.block_bytes
            raw_s, consecutive_s, scattered_s = median_seconds(
                [bench.raw_read(nbytes), bench.block_read(list(range(blocks))),
                 bench.block_read(list(range(0, 2 * blocks, 2)))], args.repeats)  # scattered: no two runs merge
            rows.append({"size_mib": size, "blocks": blocks, "raw_gib_s": nbytes / raw_s / 2**30,
                         "blocks_consecutive_gib_s": nbytes / consecutive_s / 2**30,
                         "blocks_scattered_gib_s": nbytes / scattered_s / 2**30})
        block_bytes = bench.block_bytes
    table = Table(title=f"NIXL READ, UCX loopback, block = {block_bytes // 1024} KiB")
    for col in ("size", "blocks", "raw READ", "blocks (consecutive)", "blocks (scattered)", "scattered / raw"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(f"{r['size_mib']} MiB", str(r["blocks"]), f"{r['raw_gib_s']:.2f} GiB/s",
                      f"{r['blocks_consecutive_gib_s']:.2f} GiB/s", f"{r['blocks_scattered_gib_s']:.2f} GiB/s",
                      f"{r['blocks_scattered_gib_s'] / r['raw_gib_s']:.0%}")
    console = Console()
    console.print(table)
    info = machine()
    console.print(f"machine: {info}")
    console.print(f"wrote {write_json(args.out, {'machine': info, 'block_bytes': block_bytes, 'rows': rows})}")


if __name__ == "__main__":
    main()
