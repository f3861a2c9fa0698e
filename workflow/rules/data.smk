# Manifests: the experiment's (a named synthetic mixture, or the user's own file, validated by
# `describe`) and one per mixture that a simulation or a mixture sweep needs.

# writing a config file is no job for a cluster queue: under the SLURM profile these run on the
# submitting host
localrules:
    config_resolved,
    config_view,
    experiment_file,


rule experiment_file:
    """The experiment file whose results results/<name> holds: a second file of the same
    name is refused when the Snakefile is read (adaptiveload.pipeline.check_owner)."""
    output:
        OUT.owner,
    params:
        text=f"{EXPERIMENT_FILE}\n",
    log:
        f"{LOGS}/experiment_file.log",
    conda:
        CONDA_ENV
    script:
        "../scripts/write_text.py"


rule config_resolved:
    """The validated experiment with defaults filled: what every stage of this run reads."""
    output:
        CONFIG,
    params:
        # a function: a plain string would be formatted as a pattern ("{eager, fused}" in a
        # description is not a wildcard)
        text=lambda w: yaml.safe_dump(config, sort_keys=False),
    log:
        f"{LOGS}/config_resolved.log",
    benchmark:
        f"{BENCH}/config_resolved.tsv"
    conda:
        CONDA_ENV
    script:
        "../scripts/write_text.py"


rule config_view:
    """A stage's view of the resolved experiment: the fields it reads (adaptiveload.pipeline.
    STAGE_FIELDS), at a training variant's step mode (level). Rewritten only when those
    fields change, so the stage reruns only then."""
    output:
        OUT.view("{stage}", "{level}"),
    params:
        # sorted: the order in which config files were layered must not count as a change
        text=lambda w: yaml.safe_dump(
            pipeline.stage_view(config, w.stage, pipeline.level_variant(w.level)),
            sort_keys=True,
        ),
    log:
        f"{LOGS}/config_view/{{level}}{{stage}}.log",
    benchmark:
        f"{BENCH}/config_view/{{level}}{{stage}}.tsv"
    wildcard_constraints:
        stage="|".join(pipeline.STAGE_FIELDS),
    conda:
        CONDA_ENV
    script:
        "../scripts/write_text.py"


if not config["data"]["manifest"]:

    rule manifest:
        """Synthesize the experiment's mixture (deterministic: seed 0; runs vary by plan seed)."""
        output:
            MANIFEST,
        params:
            mixture=config["data"]["mixture"],
            n=config["data"]["num_samples"],
        log:
            f"{LOGS}/manifest.log",
        benchmark:
            f"{BENCH}/manifest.tsv"
        conda:
            CONDA_ENV
        shell:
            "adaptiveload manifest synth --mixture {params.mixture:q} -n {params.n:q} --seed 0 "
            "-o {output:q} > {log:q} 2>&1"


rule describe:
    """Bucket shapes and token statistics of the manifest (also validates a user manifest)."""
    input:
        describe_input(),
    output:
        DESCRIBE,
    params:
        flags=describe_flags(),
    log:
        f"{LOGS}/describe.log",
    benchmark:
        f"{BENCH}/describe.tsv"
    conda:
        CONDA_ENV
    shell:
        "adaptiveload manifest describe {input:q} {params.flags:q} --json -o {output:q} > {log:q} 2>&1"


rule sim_manifest:
    """A mixture at the size of a simulate entry (paper scale)."""
    output:
        OUT.sim_manifest("{sim}", "{mixture}"),
    params:
        n=lambda w: SIMS[w.sim]["num_samples"],
    log:
        f"{LOGS}/sim_manifest/{{sim}}/{{mixture}}.log",
    benchmark:
        f"{BENCH}/sim_manifest/{{sim}}/{{mixture}}.tsv"
    conda:
        CONDA_ENV
    shell:
        "adaptiveload manifest synth --mixture {wildcards.mixture:q} -n {params.n:q} --seed 0 "
        "-o {output:q} > {log:q} 2>&1"
