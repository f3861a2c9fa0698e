# Shared helpers for the rules: target lists and paths derived from the validated config.
EXP = config["name"]
RES = f"results/{EXP}"


def all_targets():
    return []
