# AdaptiveLoad reproduction pipeline. Entry point: `snakemake --cores all`.
# Another experiment: `snakemake --cores all --configfile experiments/p_sweep.yaml`.
# Rules live in workflow/rules/*.smk; every stage is one `adaptiveload` CLI command.
from snakemake.utils import min_version, validate

from adaptiveload.experiment import SCHEMA_PATH, check_pipeline_config
from adaptiveload.pipeline import check_owner, check_user_inputs

min_version("8.0")


configfile: "experiments/default.yaml"


validate(config, str(SCHEMA_PATH))  # adaptiveload/experiment.schema.yaml, shipped with the package
# what JSON Schema cannot say (duplicate keys, NaN/inf), checked as `adaptiveload` commands do
check_pipeline_config(config, workflow.configfiles)
# one experiment file per results/<name> (and MLflow experiment <name>)
EXPERIMENT_FILE = check_owner(config, workflow.configfiles, workflow.overwrite_configfiles)
# the files the user brings (a manifest, a checkpoint, the empty caption's embedding) exist
check_user_inputs(config, EXPERIMENT_FILE)


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/calibrate.smk"
include: "workflow/rules/kernel.smk"
include: "workflow/rules/tracking.smk"
include: "workflow/rules/plan.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/paper_map.smk"
include: "workflow/rules/analysis.smk"


# the report opens on the experiment's headline numbers once the analysis wrote them
report: LANDING if os.path.exists(LANDING) else REPORT_DESCRIPTION


rule all:
    input:
        all_targets(),
        kernel_figure,
    default_target: True
