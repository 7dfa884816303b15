"""``deepspeed.pipe`` under llmpar: ``PipelineModule``, ``LayerSpec`` and ``TiedLayerSpec`` at DeepSpeed's names, so
that a DeepSpeed pipeline script runs with ``import llmpar as deepspeed``:

    net = deepspeed.pipe.PipelineModule(layers=[deepspeed.pipe.LayerSpec(nn.Linear, 8, 8), ...], num_stages=2,
                                        loss_fn=nn.CrossEntropyLoss(), partition_method="parameters")
    engine, _, _, _ = deepspeed.initialize(model=net, config=ds_config, training_data=dataset)
    loss = engine.train_batch()

The implementation is ``llmpar.pipeline.module`` / ``llmpar.pipeline.specs``; this shim only names it.
"""

from llmpar.pipeline.module import PipelineModule
from llmpar.pipeline.specs import LayerSpec, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
