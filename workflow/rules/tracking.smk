# The MLflow store ($MLFLOW_TRACKING_URI, else results/mlflow.db) is created by this one job
# before any job logs to it: concurrent first creation of a sqlite store crashes in MLflow's
# schema migrations.


rule tracking_init:
    output:
        touch(STORE),
    log:
        f"{LOGS}/tracking_init.log",
    benchmark:
        f"{BENCH}/tracking_init.tsv"
    conda:
        CONDA_ENV
    shell:
        "adaptiveload tracking init > {log:q} 2>&1"


rule tracking_check:
    """The end of training: every run's spooled records uploaded (a store that was full or
    down during a run), every run FINISHED in the store; else the pipeline fails here with
    one line naming the run and the fix instead of ending in success."""
    input:
        store=STORE,
        summaries=[f"{d}/summary.json" for d in run_dirs()],
    output:
        OUT.tracking_check,
    params:
        runs=run_dirs(),
        experiment=EXP,
    log:
        f"{LOGS}/tracking_check.log",
    benchmark:
        f"{BENCH}/tracking_check.tsv"
    conda:
        CONDA_ENV
    shell:
        "adaptiveload tracking check --experiment {params.experiment:q} {params.runs:q} "
        "-o {output:q} > {log:q} 2>&1"
