# The map of the paper's unpublished choices (`paper_map:` of an experiment, e.g.
# experiments/paper_map.yaml): one job plans and simulates the whole grid in-process, one draws
# it; the paper table adds the settings that reproduce the paper's numbers.


rule paper_map:
    """Baseline and AdaptiveLoad at every setting of the map (simulated, labelled `model`)."""
    input:
        config=VIEWS["paper_map"],
        calibrations=map_calibrations(),
    output:
        points=MAP_POINTS,
        summary=MAP_SUMMARY,
    log:
        f"{LOGS}/paper_map.log",
    benchmark:
        f"{BENCH}/paper_map.tsv"
    conda:
        CONDA_ENV
    shell:
        "adaptiveload analyze paper-map --config {input.config:q} --points {output.points:q} "
        "--summary {output.summary:q} > {log:q} 2>&1"


rule paper_map_figure:
    input:
        points=MAP_POINTS,
        summary=MAP_SUMMARY,
    output:
        report(f"{FIGS}/paper_map.png", caption="../report/paper_map.rst", category="Figures"),
    log:
        f"{LOGS}/paper_map_figure.log",
    benchmark:
        f"{BENCH}/paper_map_figure.tsv"
    conda:
        CONDA_ENV
    shell:
        "MPLBACKEND=Agg adaptiveload analyze paper-map-figure --points {input.points:q} "
        "--summary {input.summary:q} -o {output:q} > {log:q} 2>&1"
