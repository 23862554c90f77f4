"""The app layer: what a user runs. Hydra config (`config`), recipes (`recipes`), the trainer in parts
(`global_batches`, `model_setup`, `step`, `metrics`, `checkpoint`, `trainer`), and the commands behind
``python -m mcore_packing train`` (`train_command`) and ``python -m mcore_packing plan`` (`plan_command`).

Nothing is imported here eagerly: ``plan`` must start without torch.
"""
