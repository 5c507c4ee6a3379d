"""The doctor's checks (`python -m llama_tp.doctor`): the mesh, the split advice, where each
rank's weights come from."""
