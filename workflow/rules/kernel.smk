# The fused LayerNorm-Modulate CUDA extension: built where nvcc, ninja and a CUDA build of torch
# exist, else recorded as skipped with the reason (build/kernels/build.json); benchmarked where
# a CUDA GPU exists, else the CSV holds one `skipped` row with the reason. The library is
# shared by all experiments: every job of this workflow builds into and loads from
# build/kernels of the working directory, named to them by $ADAPTIVELOAD_BUILD_DIR (the
# installed package would otherwise use its own default, docs/kernel.md).
from adaptiveload.ops.kernel_sources import source_files

os.environ["ADAPTIVELOAD_BUILD_DIR"] = os.path.abspath(os.path.dirname(KERNEL_BUILD))


envvars:
    "ADAPTIVELOAD_BUILD_DIR",


# the CUDA sources (kernels/ of the checkout, else the installed package's copy; read without
# importing torch): an edit rebuilds the library, whose loader refuses a build of other sources
# (build.json's sources_digest)
KERNEL_SOURCES = [str(p) for p in source_files()]


rule kernel_build:
    input:
        KERNEL_SOURCES,
    output:
        KERNEL_BUILD,
    params:
        build_dir=lambda w, output: os.path.dirname(output[0]),
    log:
        f"{LOGS}/kernel_build.log",
    benchmark:
        f"{BENCH}/kernel_build.tsv"
    conda:
        CONDA_ENV
    shell:
        "adaptiveload kernel build --build-dir {params.build_dir:q} > {log:q} 2>&1"


rule kernel_bench:
    input:
        KERNEL_BUILD,
    output:
        OUT.kernel_bench,
    resources:
        gpu=1,
    log:
        f"{LOGS}/kernel_bench.log",
    benchmark:
        f"{BENCH}/kernel_bench.tsv"
    conda:
        CONDA_ENV
    shell:
        "adaptiveload kernel bench --skip-ok -o {output:q} > {log:q} 2>&1"
