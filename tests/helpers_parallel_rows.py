"""A stress run of a looped C kernel's parallel rows, in a fresh process (test_parallel_rows).

    python helpers_parallel_rows.py FOLDER

4 host devices; 4 Python threads, each on its own device, call the same jitted ``vmap`` of
a C kernel 40 times at once (the 4 calls share XLA's pool), half of the calls with failing
rows at random, garbage collection at every allocation. Every result must equal NumPy's and
every error must name the call's first failing row. Prints ``ok`` and the counts.
"""

import gc
import os
import sys
import threading

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

import test_parallel_rows  # noqa: E402


def main(folder: str) -> None:
    f = jax.jit(jax.vmap(test_parallel_rows.twice_op(folder)(), in_axes=(0, None)))
    problems, counts = [], {"ok": 0, "failed": 0}
    lock = threading.Lock()

    def worker(index: int) -> None:
        device = jax.devices()[index]
        rng = np.random.default_rng(index)
        for _ in range(40):
            rows = int(rng.integers(2, 33))
            x = rng.uniform(0.5, 2.0, (rows, 8192))
            bad = np.array([], int)
            if rng.random() < 0.5:
                bad = np.sort(rng.choice(rows, size=int(rng.integers(1, rows + 1)),
                                         replace=False))
                x[bad, 0] = -1.0 - bad
            try:
                y, _ = f(jax.device_put(x, device), 20.0)
                y = np.asarray(y)
            except Exception as error:  # noqa: BLE001 - checked below
                want = f"(row {bad[0]} of {rows})" if bad.size else None
                with lock:
                    counts["failed"] += 1
                    if want is None or want not in str(error):
                        problems.append(f"{want}: {str(error)[:300]}")
                continue
            with lock:
                counts["ok"] += 1
                if bad.size or not np.array_equal(y, 2 * x + 1):
                    problems.append(f"rows {rows}, bad {bad.tolist()}: a wrong or missing error")

    gc.set_threshold(1, 1, 1)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    gc.set_threshold(700, 10, 10)
    if any(thread.is_alive() for thread in threads):
        problems.append("a thread did not finish within 300 s")
    print("ok" if not problems else "\n".join(problems[:10]), counts, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
