"""Offline jobs that do not serve: training the shipped model (`python -m offline.train`), its
corpus and tokenizer (`offline.data`), the differentiable routing training runs
(`offline.routing`), and the evaluation of a checkpoint (`python -m offline.eval`)."""
