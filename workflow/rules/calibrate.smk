# Calibration: measure t(B,S) and memory of the real model on this device and fit the cost
# model (p, M_mem, M_comp), or take the calibration file the experiment names.

if config["calibration"]["file"]:

    rule calibrate:
        """Use the experiment's calibration file (validated by every stage that loads it)."""
        input:
            config["calibration"]["file"],
        output:
            CALIBRATION,
        log:
            f"{LOGS}/calibrate.log",
        benchmark:
            f"{BENCH}/calibrate.tsv"
        conda:
            CONDA_ENV
        shell:
            "cp {input} {output} && echo 'copied {input}' > {log}"

else:

    rule calibrate:
        """Measure this device. CUDA: the whole machine. CPU: one thread timed by its CPU
        time, the clock and thread count of the CPU training runs, so that the cost model
        predicts what they measure and a busy machine does not bend the fit."""
        input:
            config=CONFIG,
            manifest=MANIFEST,
        output:
            CALIBRATION,
        params:
            ref=" ".join(
                f"--{key.replace('_', '-')} {config['calibration'][key]}"
                for key in ("ref_tokens", "ref_batch")
                if config["calibration"][key] is not None
            ),
            timer="--timer cpu" if config["calibration"]["device"] == "cpu" else "",
        threads: ALL_CORES if config["calibration"]["device"] == "cuda" else 1
        resources:
            gpu=1 if config["calibration"]["device"] == "cuda" else 0,
        log:
            f"{LOGS}/calibrate.log",
        benchmark:
            f"{BENCH}/calibrate.tsv"
        conda:
            CONDA_ENV
        shell:
            "OMP_NUM_THREADS={threads} adaptiveload calibrate --config {input.config} --threads {threads} "
            "{params.timer} --manifest {input.manifest} {params.ref} -o {output} > {log} 2>&1"
