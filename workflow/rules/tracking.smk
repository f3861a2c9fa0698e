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
        "adaptiveload tracking init > {log} 2>&1"
