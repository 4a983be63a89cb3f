"""Tokenization throughput: our preparation (`ds_optimus.data.prepare_data`) with 1 and 2 worker
processes against `datasets`' `load_dataset("json") + map(num_proc=N)` with the same tokenizer.

The corpus is what OLMoE-mix-0924 ships, in small: gzip-compressed JSON lines files (here 8, of the
embedded Python manual's topics, ~2 MB of text each). Every contestant goes from those files to
token ids on disk (ours: flat uint16 shards with completion markers; datasets: its Arrow cache of
the parsed records and of the mapped `input_ids`), in a fresh process (so that a tokenizer's thread
setting holds from its first use) and a fresh cache folder, timed inside the process without the
imports. Contestants run in interleaved rounds after a warm-up round; medians are reported.

  ours_w1        1 worker, its tokenizer held to 1 thread (RAYON_NUM_THREADS=1)
  ours_w2        2 workers, each tokenizer held to 1 thread
  ours_w1_auto   1 worker, the tokenizer's default threading (a thread per core, in encode_batch)
  datasets_np1   datasets, num_proc=1, tokenizer parallelism off (as in its forked workers)
  datasets_np2   datasets, num_proc=2, the same

    python benchmarks/tokenize.py [--repeats 3] [--files 8] [--mb-per-file 2] [--tokenizer FOLDER]
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    # Run as a script: this folder leaves the import path first (see below), then the benchmark runs.
    import importlib.util

    HERE = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    _spec = importlib.util.spec_from_file_location("_tokenize_bench", HERE / "_tokenize_bench.py")
    _bench = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_bench)
    _bench.main(__doc__)
else:
    # This file's name is the standard library's `tokenize`, which `linecache` (so torch, traceback,
    # ...) imports: another script run from this folder has the folder first on its path and would get
    # this file. Imported so, it loads the real module in its place; the import returns that module.
    import importlib.util
    import sysconfig

    _spec = importlib.util.spec_from_file_location(__name__, Path(sysconfig.get_paths()["stdlib"]) / "tokenize.py")
    _real = importlib.util.module_from_spec(_spec)
    sys.modules[__name__] = _real
    _spec.loader.exec_module(_real)
