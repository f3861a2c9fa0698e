# Plans: which samples form each micro-batch and which rank runs it, per policy and seed.
# The training setup's plans are the ones `train` executes (same manifest, calibration, seed);
# the simulations plan paper-scale mixtures and predict them through a calibration file.
# Every plan is simulated once, by `adaptiveload plan` itself: the plan summary's predictions
# and a simulation's per-step table and run summary come from that one simulation.


rule plan:
    """The training plan of one policy and seed at one step mode (level): its summary (what
    `train --plan` checks the plan it executes against, with the cost model's predictions)."""
    input:
        manifest=MANIFEST,
        calibration=CALIBRATION,
    output:
        summary=OUT.plan("{policy}", "{seed}", "{level}"),
    params:
        flags=["--world-size", config["train"]["world_size"], *bucket_flags(config["data"]),
               "--short-clips", config["data"]["short_clips"], *budget_flags(),
               "--allreduce-gbps", config["train"]["allreduce_gbps"], *val_split_flags()],
        steps=step_mode,
    log:
        f"{LOGS}/plan/{{level}}{{policy}}/seed{{seed}}.log",
    benchmark:
        f"{BENCH}/plan/{{level}}{{policy}}/seed{{seed}}.tsv"
    conda:
        CONDA_ENV
    shell:
        "adaptiveload plan --manifest {input.manifest:q} --policy {wildcards.policy:q} "
        "--seed {wildcards.seed:q} --calibration {input.calibration:q} {params.flags:q} "
        "--steps-per-epoch {params.steps:q} --summary {output.summary:q} > {log:q} 2>&1"


rule sim_budgets:
    """A simulate entry's budgets at its own capacity_gb: its calibration's derived again for
    the mixture's samples (bucketed as the entry buckets them) on a device of that memory."""
    input:
        manifest=lambda w: OUT.sim_manifest(w.sim, w.mixture),
        calibration=lambda w: SIMS[w.sim]["calibration"],
    output:
        OUT.sim_budgets("{sim}", "{mixture}"),
    params:
        flags=lambda w: [*bucket_flags(SIMS[w.sim]), "--capacity-gb", SIMS[w.sim]["capacity_gb"]],
    log:
        f"{LOGS}/sim_budgets/{{sim}}/{{mixture}}.log",
    conda:
        CONDA_ENV
    shell:
        "adaptiveload budgets --calibration {input.calibration:q} --manifest {input.manifest:q} "
        "{params.flags:q} > {output:q} 2> {log:q}"


rule simulate:
    """Plan one sweep point of a simulate entry and predict it through its calibration: the
    per-step table and the run summary (the plan's own summary inside it) the analysis reads.
    A prediction has no warm-up: its summary covers every step of the epoch."""
    input:
        manifest=sim_manifest,
        calibration=lambda w: SIMS[w.sim]["calibration"],
        budgets=sim_budgets,
    output:
        steps=f"{OUT.sim_dir('{sim}', '{variant}', '{policy}', '{seed}')}/steps.parquet",
        summary=f"{OUT.sim_dir('{sim}', '{variant}', '{policy}', '{seed}')}/summary.json",
    params:
        flags=sim_flags,
        experiment=EXP,
    log:
        f"{LOGS}/simulate/{{sim}}/{{variant}}/{{policy}}/seed{{seed}}.log",
    benchmark:
        f"{BENCH}/simulate/{{sim}}/{{variant}}/{{policy}}/seed{{seed}}.tsv"
    conda:
        CONDA_ENV
    shell:
        "adaptiveload plan --manifest {input.manifest:q} --policy {wildcards.policy:q} "
        "--seed {wildcards.seed:q} --calibration {input.calibration:q} {params.flags:q} "
        "--simulation-steps {output.steps:q} "
        "--simulation-summary {output.summary:q} --experiment {params.experiment:q} > {log:q} 2>&1"
