"""The Python half of scripts/device-check (run as `python -m devicecheck` with scripts/ on the path).

    main.py       arguments, the order of the sections, the exit status
    report.py     the JSON report (saved after every section), the time budget, the Markdown summary
    install.py    onnxruntime-gpu from wheel parts into a private folder first on the path, CUDA
                  library preloading, the one-MatMul smoke test on the device
    checks.py     tiny artifacts: logits vs CPU, greedy with and without speculation, K/V residency
    probe.py      the performance probe on a random model of Llama-3.2-1B's shape
    cudagraph.py  the probe's CUDA graph part: decode steps replayed from a captured graph

docs/gpu.md describes the procedure and what each number means.
"""
