"""Which models one deployment serves, under which API names, each in which group of keys.

`--model` may be given several times (`iterserve up --model A --model B`; the environment's
ITERSERVE_MODEL holds them comma-separated), with as many `--served-model-name`s or none (each
model is then named after its file or directory). One model is served from the unnamed group
of keys; several each get the group of their name (shared/keys.py ModelKeys), and `up` starts a
scheduler and `--workers` workers for each. A scheduler or worker serves exactly one model: the
group is given to it as ITERSERVE_MODEL_GROUP.
"""

from dataclasses import dataclass

from shared.keys import ModelKeys
from shared.model_file import ModelFileError, load_metadata


@dataclass(frozen=True)
class ServedModel:
    path: str  # what --model said: the packaged model's name, a GGUF file or a checkpoint directory
    name: str  # the API's name for it (`model` in requests, /v1/models)
    keys: ModelKeys


def split_list(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def served_models(settings) -> list[ServedModel]:
    """The deployment's models in the order given; the first is the default of requests that name none.
    A model that cannot be served raises ModelFileError."""
    paths = split_list(settings.model)
    names = split_list(settings.served_model_name)
    if names and len(names) != len(paths):
        raise ModelFileError(f"{len(paths)} models and {len(names)} served model names: give one name per --model")
    names = names or [load_metadata(path).name for path in paths]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ModelFileError(f"two models would be served as {', '.join(duplicates)}: name each with "
                             "--served-model-name")
    if len(paths) == 1:
        load_metadata(paths[0])
        return [ServedModel(paths[0], names[0], ModelKeys(settings.model_group))]
    for path in paths:
        load_metadata(path)
    return [ServedModel(path, name, ModelKeys(name)) for path, name in zip(paths, names, strict=True)]
