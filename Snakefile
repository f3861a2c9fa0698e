# AdaptiveLoad reproduction pipeline. Entry point: `snakemake --cores all`.
# Rules live in workflow/rules/*.smk; every stage is one `adaptiveload` CLI command.
from snakemake.utils import min_version, validate

min_version("8.0")


configfile: "experiments/default.yaml"


validate(config, "workflow/schemas/config.schema.yaml")


include: "workflow/rules/common.smk"


rule all:
    input:
        all_targets(),
    default_target: True
