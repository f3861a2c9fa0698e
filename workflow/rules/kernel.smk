# The fused LayerNorm-Modulate CUDA extension: built where nvcc and a CUDA torch exist (else a
# recorded skip with its reason), benchmarked where a CUDA GPU exists (else a recorded skip).


rule kernel_build:
    output:
        f"{RES}/kernel/build.json",
    params:
        enabled="" if config["kernel"]["build"] else "--skip 'kernel.build is false'",
    log:
        f"{LOGS}/kernel_build.log",
    benchmark:
        f"{BENCH}/kernel_build.tsv"
    conda:
        CONDA_ENV
    shell:
        "adaptiveload kernel build --status {output} {params.enabled} > {log} 2>&1"


rule kernel_bench:
    input:
        f"{RES}/kernel/build.json",
    output:
        status=f"{RES}/kernel/bench.json",
    params:
        csv=f"{RES}/kernel/bench.csv",
        enabled="" if config["kernel"]["bench"] else "--skip 'kernel.bench is false'",
    resources:
        gpu=1,
    log:
        f"{LOGS}/kernel_bench.log",
    benchmark:
        f"{BENCH}/kernel_bench.tsv"
    conda:
        CONDA_ENV
    shell:
        "adaptiveload kernel bench --status {output.status} --csv {params.csv} {params.enabled} "
        "> {log} 2>&1"
