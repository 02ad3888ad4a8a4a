"""The built-in model families, one module each (a module may hold a lineage: llama.py has Llama, Mistral and
Mixtral). Importing this package registers them all in `models/family.py`'s table, in the order below (the order
error messages list them in); the table's lookups are re-exported here so that whoever uses them has the
built-ins registered first."""

# isort: skip_file
from posttrain.models.families import llama, qwen, gemma, gemma4, gpt_oss, qwen3_5, qwen3_vl  # noqa: F401, E501
from posttrain.models.family import (  # noqa: F401
    Family,
    families,
    family_named,
    family_of_multimodal,
    family_of_type,
    model_types,
    register_family,
)
