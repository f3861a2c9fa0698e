"""The job of the rules that write a file Snakemake computed (config_resolved, config_view,
run_index, experiment_file): their `params.text` to their output, one line to their log.

A `script:` job runs through the job shell (`adaptiveload-job`) as every shell job does, so it
dies with a killed Snakemake. A `run:` block would not: Snakemake runs it in a separate
`/bin/sh -c "python -m snakemake --target-jobs ..."` that parses the whole workflow again and
outlives a `kill -9` of Snakemake by as long as that takes, then writes its output.
"""

from adaptiveload.io import write_text

job = snakemake  # noqa: F821 (defined by the preamble Snakemake puts before this script)
write_text(job.output[0], job.params.text)
write_text(job.log[0], f"wrote {job.output[0]}\n")
