"""Checkpoint formats of a K3 model directory, apart from the network itself.

`layouts.py` (the released layouts and the names they share), `config_json.py` (config.json written and read),
`names.py` (tensor names: experts per expert, the layouts' prefixes), `load.py` (`load_model`, `check_model_dir`:
read and checked), `save.py` (`save_model`), `weight_files.py` (safetensors shards and index), `mxfp4.py`,
`trust.py` (a directory's code only on request, its paths only inside it), `integrity.py` (the `COMPLETE` manifest,
finite weights) and `remote/` (the code copied into every checkpoint for tools that do not import k3rl).
"""
