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
            "cp {input:q} {output:q} && echo copied {input:q} > {log:q}"

else:

    rule calibrate:
        """Measure this device as the experiment's calibration section says (threads: the ones
        its clock needs, one on a CPU where the timer counts that thread's CPU seconds, else
        the whole machine)."""
        input:
            config=VIEWS["calibrate"],
            manifest=MANIFEST,
        output:
            CALIBRATION,
        threads: calibration_threads()
        resources:
            gpu=1 if config["calibration"]["device"] == "cuda" else 0,
        log:
            f"{LOGS}/calibrate.log",
        benchmark:
            f"{BENCH}/calibrate.tsv"
        conda:
            CONDA_ENV
        shell:
            "OMP_NUM_THREADS={threads} adaptiveload calibrate measure --config {input.config:q} "
            "--threads {threads} --manifest {input.manifest:q} -o {output:q} > {log:q} 2>&1"
