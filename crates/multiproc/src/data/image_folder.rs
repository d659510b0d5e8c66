//! [`ImageFolder`] (feature `image`): torch vision's `ImageFolder`, a data set of the
//! image files under a directory, one class per subdirectory, decoded in the workers.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::dataset::Dataset;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// The image files under `root`: `root/<class>/<file>` with the classes in name order
/// (labels `0..`), or, when `root` has no subdirectory, every file of `root` with
/// label 0. Only the formats this build can decode are taken (PNG with the crate's
/// `image` feature).
///
/// A sample is `(image, label)`: the image a `[3, height, width]` `U8` tensor (RGB, the
/// layout of torch's `to_tensor` before scaling), the label an `i64`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ImageFolder {
    files: Vec<(PathBuf, i64)>,
    classes: Vec<String>,
    size: Option<(u32, u32)>,
}

impl ImageFolder {
    /// The images under `root`.
    ///
    /// # Errors
    /// [`Error::Os`] when a directory cannot be read; [`Error::InvalidArgument`] when it
    /// holds no image this build can decode.
    pub fn new(root: impl AsRef<Path>) -> Result<Self> {
        let root = root.as_ref();
        let mut dirs: Vec<PathBuf> = list(root)?.into_iter().filter(|p| p.is_dir()).collect();
        dirs.sort();
        let (classes, groups): (Vec<String>, Vec<PathBuf>) = if dirs.is_empty() {
            (vec![String::new()], vec![root.to_path_buf()])
        } else {
            dirs.into_iter()
                .map(|d| {
                    let name = d.file_name().map(|n| n.to_string_lossy().into_owned());
                    (name.unwrap_or_default(), d)
                })
                .unzip()
        };
        let mut files = Vec::new();
        for (label, dir) in groups.iter().enumerate() {
            let mut images: Vec<PathBuf> =
                list(dir)?.into_iter().filter(|p| decodable(p)).collect();
            images.sort();
            files.extend(images.into_iter().map(|p| (p, label as i64)));
        }
        if files.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "{} holds no image this build can decode (PNG files, directly or in one \
                 subdirectory per class)",
                root.display()
            )));
        }
        Ok(ImageFolder {
            files,
            classes,
            size: None,
        })
    }

    /// Resize every image to `width × height` (so images of different sizes stack).
    pub fn resize(mut self, width: u32, height: u32) -> Self {
        self.size = Some((width, height));
        self
    }

    /// The class names, by label.
    pub fn classes(&self) -> &[String] {
        &self.classes
    }

    /// The file of sample `index` and its label.
    pub fn file(&self, index: usize) -> Option<(&Path, i64)> {
        self.files.get(index).map(|(p, l)| (p.as_path(), *l))
    }
}

impl Dataset for ImageFolder {
    type Item = (Tensor, i64);

    fn len(&self) -> usize {
        self.files.len()
    }

    fn get(&self, index: usize) -> Result<(Tensor, i64)> {
        let (path, label) = self.files.get(index).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "image {index} does not exist: the folder has {} images",
                self.files.len()
            ))
        })?;
        let decoded = image::open(path).map_err(|e| {
            Error::InvalidArgument(format!("cannot decode {}: {e}", path.display()))
        })?;
        let mut rgb = decoded.into_rgb8();
        if let Some((w, h)) = self.size {
            if rgb.dimensions() != (w, h) {
                rgb = image::imageops::resize(&rgb, w, h, image::imageops::FilterType::Triangle);
            }
        }
        let (w, h) = (rgb.width() as usize, rgb.height() as usize);
        // Decoded as height × width × channel; planar [3, h, w] in a private buffer, so
        // that collate's copy into the shared batch is one contiguous run per image
        // (a strided copy out of the interleaved pixels is several times slower).
        let hwc = rgb.into_raw();
        let plane = h * w;
        let mut chw = vec![0u8; 3 * plane];
        for (p, px) in hwc.chunks_exact(3).enumerate() {
            chw[p] = px[0];
            chw[plane + p] = px[1];
            chw[2 * plane + p] = px[2];
        }
        Ok((Tensor::from_vec(chw, &[3, h, w])?, *label))
    }
}

fn list(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| Error::os(format!("cannot read the image folder {}", dir.display()), e))?;
    Ok(entries.filter_map(|e| e.ok().map(|e| e.path())).collect())
}

fn decodable(path: &Path) -> bool {
    path.is_file() && image::ImageFormat::from_path(path).is_ok_and(|f| f.reading_enabled())
}
