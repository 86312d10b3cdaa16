"""The hooks a vlmd plugin may implement. One documented function per hook.

Plugins are found through the ``vlmd.model_families`` entry-point group; the built-in
families (LLaVA, ...) are separate packages that register through these same hooks.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("vlmd")
hookimpl = pluggy.HookimplMarker("vlmd")


@hookspec
def vlmd_register_model_families(registry):
    """Register model families with ``registry.register(ModelFamily(...))``.

    A family names the HF ``architectures`` it serves and, as lazy ``"module:attr"``
    strings, its model class, processing info, processor and dummy-inputs builder.
    Registering an architecture that is already registered logs a warning and the later
    registration wins, so a third-party package can replace a built-in family. pluggy
    calls implementations newest-registered first and entry-point load order follows
    install order, so a package that means to override declares
    ``@hookimpl(trylast=True)`` to be sure it registers last.
    """


@hookspec
def vlmd_register_tiny_builders(builders):
    """Add this package's random test-checkpoint builders to the dict ``builders``.

    ``builders[family] = "module:function"``, where the function is
    ``f(out_dir, seed=..., size=...) -> Path`` and writes a checkpoint that transformers
    loads offline (``python -m vlmd.tiny --family FAMILY`` finds it here, and ``vlmd serve``
    without MODEL_DIR builds its default with the ``llava`` one).
    """


@hookspec
def vlmd_register_converters(converters):
    """Add this package's checkpoint converters to the dict ``converters``.

    ``converters[format] = "module:function"``, where the function is
    ``f(source_dir, target_dir) -> Path`` and writes a Hugging Face checkpoint
    (``vlmd convert --from FORMAT`` finds it here).
    """
