# Analysis: one tidy table of all runs -> statistical tests -> paper tables and figures (in the
# Snakemake report with captions) -> one "analysis" run in MLflow.


rule run_index:
    """Every run the analysis reads (adaptiveload.pipeline.run_index): a file, rewritten when
    the experiment's runs change."""
    output:
        OUT.run_index,
    params:
        # a function: the index is this rule's params, so a changed index reruns it
        text=lambda w: json_text(pipeline.run_index(config)),
    log:
        f"{LOGS}/run_index.log",
    benchmark:
        f"{BENCH}/run_index.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/write_text.py"


rule aggregate:
    input:
        index=OUT.run_index,
        runs=pipeline.run_files(pipeline.run_index(config)),
    output:
        runs=f"{OUT.analysis}/runs.parquet",
        steps=f"{OUT.analysis}/steps.parquet",
    log:
        f"{LOGS}/aggregate.log",
    benchmark:
        f"{BENCH}/aggregate.tsv"
    conda:
        CONDA_ENV
    shell:
        "adaptiveload analyze aggregate --index {input.index:q} --runs-out {output.runs:q} "
        "--steps-out {output.steps:q} > {log:q} 2>&1"


rule stats:
    input:
        runs=rules.aggregate.output.runs,
    output:
        csv=f"{TABLES}/stats.csv",
        md=f"{TABLES}/stats.md",
    params:
        a=config["analysis"],
    log:
        f"{LOGS}/stats.log",
    benchmark:
        f"{BENCH}/stats.tsv"
    conda:
        CONDA_ENV
    shell:
        "adaptiveload analyze stats --runs {input.runs:q} --csv {output.csv:q} "
        "--md {output.md:q} --baseline {params.a[baseline]:q} --seed {params.a[seed]:q} > {log:q} 2>&1"


rule convergence:
    """Time to a target validation loss and the loss at equal samples seen, per policy vs the
    baseline (runs that score a held-out set: train.val_every > 0)."""
    input:
        steps=rules.aggregate.output.steps,
    output:
        csv=f"{TABLES}/convergence.csv",
        md=f"{TABLES}/convergence.md",
    params:
        a=config["analysis"],
    log:
        f"{LOGS}/convergence.log",
    benchmark:
        f"{BENCH}/convergence.tsv"
    conda:
        CONDA_ENV
    shell:
        "adaptiveload analyze convergence --steps {input.steps:q} --csv {output.csv:q} "
        "--md {output.md:q} --baseline {params.a[baseline]:q} --seed {params.a[seed]:q} "
        "> {log:q} 2>&1"


rule tables:
    input:
        runs=rules.aggregate.output.runs,
        steps=rules.aggregate.output.steps,
        stats=rules.stats.output.csv,
        kernel=KERNEL_BENCH,
        paper_map=[MAP_SUMMARY] if PAPER_MAP else [],
    output:
        f"{TABLES}/headline.md",
        report(f"{TABLES}/headline.html", caption="../report/headline.rst", category="Tables"),
        f"{TABLES}/paper_table.csv",
        f"{TABLES}/paper_table.md",
        report(f"{TABLES}/paper_table.html", caption="../report/paper_table.rst",
               category="Tables"),
        f"{TABLES}/kernel_table.csv",
        f"{TABLES}/kernel_table.md",
        report(f"{TABLES}/kernel_table.html", caption="../report/kernel_table.rst",
               category="Tables"),
    params:
        kernel=lambda w, input: ["--kernel-bench", *input.kernel] if input.kernel else [],
        paper_map=lambda w, input: ["--paper-map", *input.paper_map] if input.paper_map else [],
        baseline=config["analysis"]["baseline"],
        out=lambda w, output: os.path.dirname(output[0]),
    log:
        f"{LOGS}/tables.log",
    benchmark:
        f"{BENCH}/tables.tsv"
    conda:
        CONDA_ENV
    shell:
        "adaptiveload analyze tables --runs {input.runs:q} --steps {input.steps:q} --stats {input.stats:q} "
        "--out-dir {params.out:q} {params.kernel:q} {params.paper_map:q} "
        "--baseline {params.baseline:q} > {log:q} 2>&1"


rule figures:
    input:
        runs=rules.aggregate.output.runs,
        steps=rules.aggregate.output.steps,
        stats=rules.stats.output.csv,
        describe=DESCRIBE,
        calibration=CALIBRATION if TRAIN else next(iter(SIMS.values()))["calibration"],
        kernel=KERNEL_BENCH,
    output:
        [report(f"{FIGS}/{name}.png", caption=f"../report/{name}.rst", category="Figures")
         for name in figure_names()],
    params:
        figures=[item for name in figure_names() for item in ("--figure", name)],
        kernel=lambda w, input: ["--kernel-bench", *input.kernel] if input.kernel else [],
        out=lambda w, output: os.path.dirname(output[0]),
        mixture=config["data"]["manifest"] or config["data"]["mixture"],
    log:
        f"{LOGS}/figures.log",
    benchmark:
        f"{BENCH}/figures.tsv"
    conda:
        CONDA_ENV
    shell:
        "MPLBACKEND=Agg adaptiveload analyze figures --runs {input.runs:q} --steps {input.steps:q} "
        "--stats {input.stats:q} --describe {input.describe:q} --calibration {input.calibration:q} "
        "{params.kernel:q} --mixture {params.mixture:q} --out-dir {params.out:q} "
        "{params.figures:q} > {log:q} 2>&1"


rule record:
    """The analysis as its own MLflow run, beside the training runs of this experiment."""
    input:
        store=STORE,
        trained=[OUT.tracking_check] if TRAIN else [],
        config=CONFIG,
        paper=f"{TABLES}/paper_table.csv",
        stats=rules.stats.output.csv,
        files=[f"{TABLES}/stats.md", *TABLE_FILES, *CONVERGENCE_FILES,
               *[f"{FIGS}/{name}.png" for name in figure_names()]],
    output:
        f"{OUT.analysis}/mlflow_analysis.json",
    params:
        artifacts=lambda w, input: [item for f in input.files for item in ("--artifact", f)],
        experiment=EXP,
    log:
        f"{LOGS}/record.log",
    benchmark:
        f"{BENCH}/record.tsv"
    conda:
        CONDA_ENV
    shell:
        "adaptiveload analyze record --experiment {params.experiment:q} --paper-table {input.paper:q} "
        "--stats {input.stats:q} --config {input.config:q} {params.artifacts:q} -o {output:q} > {log:q} 2>&1"
