# Training: one measured run per policy x seed x kernel, N ranks emulated on one device (or
# one process per rank under torchrun; see README). Each run logs to MLflow and writes its
# per-step table and summary under results/<name>/runs/.


rule train:
    """Measured run at one step mode (level: its view holds the mode). On CUDA it takes the whole machine. On a CPU its ranks are emulated in one
    thread timed by that thread's CPU time, which runs beside it do not disturb: one core
    each, so runs go side by side."""
    input:
        config=OUT.view("train", "{level}"),
        manifest=MANIFEST,
        calibration=CALIBRATION,
        plan=OUT.plan("{policy}", "{seed}", "{level}"),
        store=STORE,
        kernel=lambda w: KERNEL_BUILD if w.kernel == "fused" else [],
        init=init_files(),
    output:
        steps=f"{OUT.run_dir('{policy}', '{seed}', '{kernel}', '{level}')}/steps.parquet",
        summary=f"{OUT.run_dir('{policy}', '{seed}', '{kernel}', '{level}')}/summary.json",
    params:
        out=lambda w, output: os.path.dirname(output.summary),
    threads: ALL_CORES if config["calibration"]["device"] == "cuda" else 1
    resources:
        gpu=1 if config["calibration"]["device"] == "cuda" else 0,
    log:
        f"{LOGS}/train/{{level}}{{policy}}/seed{{seed}}/{{kernel}}.log",
    benchmark:
        f"{BENCH}/train/{{level}}{{policy}}/seed{{seed}}/{{kernel}}.tsv"
    conda:
        CONDA_ENV
    shell:
        "OMP_NUM_THREADS={threads} ADAPTIVELOAD_DIE_WITH_PARENT=1 exec adaptiveload train "
        "--config {input.config:q} "
        "--policy {wildcards.policy:q} --seed {wildcards.seed:q} --kernel {wildcards.kernel:q} "
        "--calibration {input.calibration:q} --manifest {input.manifest:q} --plan {input.plan:q} "
        "--out {params.out:q} > {log:q} 2>&1"
