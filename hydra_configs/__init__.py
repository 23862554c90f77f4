"""The Hydra config of ``python -m mcore_packing train``, installed as package data
(``mcore_packing.hydra_configs``, mapped from this folder in pyproject.toml) so a wheel carries it."""
