"""The few AdamW steps the model tests train with (the same batches on every device)."""
import torch


def train_losses(model, device: str, steps: int = 3, vocab: int = 128, lr: float = 1e-3,
                 shape: tuple[int, int] = (2, 16), low: int = 0) -> list[float]:
    """Moves `model` to `device`, takes `steps` AdamW steps on random token batches, returns the losses."""
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(low, vocab, shape, generator=gen).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
