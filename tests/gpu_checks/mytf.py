"""A user's own torchvision recipe for the GPU check: RandomResizedCrop, flip, RandAugment."""
import torchvision.transforms as T


def make_train(size=224):
    return T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.RandAugment(num_ops=2, magnitude=9)])
