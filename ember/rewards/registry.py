"""Choose the reward function for a run: a user's file, an import path, or routing by data_source.

Three sources, in verl's config names:

- ``custom_reward_function.path`` / ``.name`` / ``.reward_kwargs``: a function in a Python file;
- ``data.reward_fn``: ``{"_target_": "pkg.module.fn", **kwargs}``, a function by import path;
- neither: ``ember.rewards.routing.default_compute_score``, which picks a scorer by data_source.

The result is a ``RewardFnSpec``: only strings and the keyword arguments, so it pickles to
reward worker processes, each of which imports the function itself with ``spec.load()``.
``resolve_reward_fn`` loads it once in the calling process, so a wrong path, name or keyword
argument fails at start-up with a message, not inside a worker.
"""

import hashlib
import importlib
import importlib.machinery
import importlib.util
import os
import sys
from dataclasses import dataclass, field

from ember.rewards.contract import BatchRewardFn, BoundRewardFn, RewardConfigError

DEFAULT_MODULE = "ember.rewards.routing"
DEFAULT_NAME = "default_compute_score"


@dataclass(frozen=True)
class RewardFnSpec:
    """Where a reward function lives and the keyword arguments bound to it."""

    location: str  # dotted module path, or absolute path of a Python file when from_file
    name: str  # attribute of that module holding the function
    kwargs: dict = field(default_factory=dict)  # bound as keyword arguments on every call
    from_file: bool = False  # location is a file path rather than a module path
    origin: str = "built-in routing"  # the config key it came from, named in error messages

    def describe(self) -> str:
        """``location:name``, as shown in logs and errors."""
        return f"{self.location}:{self.name}"

    def load(self, batched: bool = False) -> BoundRewardFn | BatchRewardFn:
        """Import the function and bind its keyword arguments (as a batch function when `batched`)."""
        module = _import_file(self) if self.from_file else _import_module(self)
        fn = getattr(module, self.name, None)
        if not callable(fn):
            defined = sorted(
                name
                for name, value in vars(module).items()
                if callable(value) and getattr(value, "__module__", None) == module.__name__
            )
            raise RewardConfigError(
                f"{self.origin}: no function {self.name!r} in {self.location} "
                f"(functions defined there: {defined}); set the name of your reward function"
            )
        return (BatchRewardFn if batched else BoundRewardFn)(fn, self.kwargs, self.describe())


def _import_module(spec: RewardFnSpec):
    try:
        return importlib.import_module(spec.location)
    except ModuleNotFoundError as error:
        if error.name is None or not f"{spec.location}.".startswith(f"{error.name}."):
            raise  # the module exists; something it imports is missing
        raise RewardConfigError(
            f"{spec.origin}: cannot import module {spec.location!r} for reward function "
            f"{spec.name!r}; check the dotted path and that the package is installed"
        ) from error


def _import_file(spec: RewardFnSpec):
    """Execute the Python file at ``spec.location`` as a fresh module."""
    path = spec.location
    if not os.path.isfile(path):
        raise RewardConfigError(f"{spec.origin}={path!r}: no such file; point it at a Python file")
    # A stable name per path, so that classes defined in the file pickle the same in workers.
    digest = hashlib.sha1(path.encode()).hexdigest()[:10]
    module_name = f"ember_reward_{os.path.splitext(os.path.basename(path))[0]}_{digest}"
    loader = importlib.machinery.SourceFileLoader(module_name, path)
    module_spec = importlib.util.spec_from_file_location(module_name, path, loader=loader)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    loader.exec_module(module)
    return module


def _spec_from_target(target_spec: dict) -> RewardFnSpec:
    kwargs = dict(target_spec)
    target = kwargs.pop("_target_", None)
    if not isinstance(target, str) or "." not in target.replace(":", "."):
        raise RewardConfigError(
            f"data.reward_fn needs '_target_' set to a function's import path such as "
            f"'ember.rewards.gsm8k.compute_score', got {target!r}"
        )
    separator = ":" if ":" in target else "."
    module, name = target.rsplit(separator, 1)
    return RewardFnSpec(module, name, kwargs, origin="data.reward_fn._target_")


def resolve_reward_fn(
    custom_path: str | None = None,
    custom_name: str = "compute_score",
    reward_kwargs: dict | None = None,
    target_spec: dict | None = None,
    batched: bool = False,
) -> RewardFnSpec:
    """The spec of the run's reward function, checked by loading it once here (against the batch
    contract when `batched`: the `batch` reward manager).

    Args:
        custom_path: ``custom_reward_function.path``, a Python file defining the function.
        custom_name: ``custom_reward_function.name``, the function's name in that file.
        reward_kwargs: ``custom_reward_function.reward_kwargs``, bound to the custom function.
        target_spec: ``data.reward_fn``, ``{"_target_": dotted path, **kwargs}``.
    """
    reward_kwargs = dict(reward_kwargs or {})
    if custom_path and target_spec:
        raise RewardConfigError(
            "both custom_reward_function.path and data.reward_fn are set; keep one of them"
        )
    if custom_path:
        spec = RewardFnSpec(
            location=os.path.abspath(custom_path),
            name=custom_name or "compute_score",
            kwargs=reward_kwargs,
            from_file=True,
            origin="custom_reward_function.path",
        )
    elif reward_kwargs:
        raise RewardConfigError(
            f"custom_reward_function.reward_kwargs {sorted(reward_kwargs)} are set without "
            "custom_reward_function.path; set the path, or put the arguments in data.reward_fn"
        )
    elif target_spec:
        spec = _spec_from_target(target_spec)
    else:
        if batched:
            raise RewardConfigError("reward_model.reward_manager=batch calls a function of lists, which the built-in "
                                    "scorers are not: set custom_reward_function.path (or data.reward_fn) to one")
        spec = RewardFnSpec(DEFAULT_MODULE, DEFAULT_NAME)
    spec.load(batched=batched)
    return spec
