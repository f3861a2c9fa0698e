# Plans: which samples form each micro-batch and which rank runs it, per policy and seed.
# The training setup's plans are the ones `train` executes (same manifest, calibration, seed);
# the simulations plan paper-scale mixtures and predict them through a calibration file.


rule plan:
    """The training plan of one policy and seed (with the cost model's predictions)."""
    input:
        manifest=MANIFEST,
        calibration=CALIBRATION,
    output:
        plan=f"{RES}/plans/{{policy}}/seed{{seed}}.parquet",
        summary=f"{RES}/plans/{{policy}}/seed{{seed}}.json",
    params:
        flags=f"--world-size {config['train']['world_size']} {bucket_flags(config['data'])} "
        f"{budget_flags()} --allreduce-gbps {config['train']['allreduce_gbps']}",
    log:
        f"{LOGS}/plan/{{policy}}/seed{{seed}}.log",
    benchmark:
        f"{BENCH}/plan/{{policy}}/seed{{seed}}.tsv"
    conda:
        CONDA_ENV
    shell:
        "adaptiveload plan --manifest {input.manifest} --policy {wildcards.policy} "
        "--seed {wildcards.seed} --calibration {input.calibration} {params.flags} "
        "-o {output.plan} --summary {output.summary} > {log} 2>&1"


rule simulate:
    """Plan one sweep point of a simulate entry and predict it through its calibration."""
    input:
        manifest=sim_manifest,
        calibration=lambda w: SIMS[w.sim]["calibration"],
    output:
        plan=f"{RES}/sim/{{sim}}/{{variant}}/{{policy}}/seed{{seed}}/plan.parquet",
        plan_summary=f"{RES}/sim/{{sim}}/{{variant}}/{{policy}}/seed{{seed}}/plan.json",
        steps=f"{RES}/sim/{{sim}}/{{variant}}/{{policy}}/seed{{seed}}/steps.parquet",
        summary=f"{RES}/sim/{{sim}}/{{variant}}/{{policy}}/seed{{seed}}/summary.json",
    params:
        flags=sim_flags,
        gbps=lambda w: SIMS[w.sim]["allreduce_gbps"],
        warmup=config["train"]["warmup_steps"],
        experiment=EXP,
    log:
        f"{LOGS}/simulate/{{sim}}/{{variant}}/{{policy}}/seed{{seed}}.log",
    benchmark:
        f"{BENCH}/simulate/{{sim}}/{{variant}}/{{policy}}/seed{{seed}}.tsv"
    conda:
        CONDA_ENV
    shell:
        "(adaptiveload plan --manifest {input.manifest} --policy {wildcards.policy} "
        "--seed {wildcards.seed} --calibration {input.calibration} {params.flags} "
        "-o {output.plan} --summary {output.plan_summary} && "
        "adaptiveload simulate --plan {output.plan} --calibration {input.calibration} "
        "--allreduce-gbps {params.gbps} --warmup-steps {params.warmup} "
        "--experiment {params.experiment} "
        "-o {output.steps} --summary {output.summary}) > {log} 2>&1"
