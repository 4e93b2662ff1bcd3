//! Device memory of one simulated context: allocations keyed by their device address,
//! backed by host memory page by page as it is first written.
//!
//! Why sparse: a check may allocate most of a GPU's memory (tens of GiB) only to see the
//! allocation succeed; host memory is spent only on the pages a copy or a kernel touches.
//! Untouched bytes read as zero. Invariant: allocations never overlap, and every access
//! lies wholly inside one allocation or is refused with its address.

use std::collections::{BTreeMap, HashMap};

use crate::ptx;

/// Bytes per backing page.
const PAGE: u64 = 64 * 1024;
/// Alignment and granularity of device addresses (CUDA aligns allocations to at least 256
/// bytes; the driver's own granularity is 2 MiB, which keeps addresses looking real).
const GRANULARITY: u64 = 2 * 1024 * 1024;

#[derive(Debug, Default)]
struct Allocation {
    size: u64,
    pages: HashMap<u64, Box<[u8]>>,
}

/// The allocations of one context.
#[derive(Debug)]
pub struct DeviceMemory {
    allocations: BTreeMap<u64, Allocation>,
    next: u64,
    used: u64,
}

impl DeviceMemory {
    /// Memory whose addresses start at `base` (distinct per context).
    pub fn new(base: u64) -> DeviceMemory {
        DeviceMemory {
            allocations: BTreeMap::new(),
            next: base,
            used: 0,
        }
    }

    /// Bytes allocated.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// A new allocation of `size` bytes (> 0); its device address.
    pub fn alloc(&mut self, size: u64) -> u64 {
        let at = self.next;
        self.next += size.div_ceil(GRANULARITY).max(1) * GRANULARITY;
        self.allocations.insert(
            at,
            Allocation {
                size,
                pages: HashMap::new(),
            },
        );
        self.used += size;
        at
    }

    /// Frees the allocation starting at `ptr`; its size, `None` when no allocation starts
    /// there.
    pub fn free(&mut self, ptr: u64) -> Option<u64> {
        let a = self.allocations.remove(&ptr)?;
        self.used -= a.size;
        Some(a.size)
    }

    /// The allocation holding `[addr, addr + len)`, and `addr`'s offset in it.
    fn find(&self, addr: u64, len: u64) -> Option<(u64, u64)> {
        let (&base, a) = self.allocations.range(..=addr).next_back()?;
        let off = addr - base;
        (off.checked_add(len)? <= a.size).then_some((base, off))
    }

    /// Copies `data` to `addr`; `Err(addr)` outside every allocation.
    pub fn write_bytes(&mut self, addr: u64, data: &[u8]) -> Result<(), u64> {
        let (base, mut off) = self.find(addr, data.len() as u64).ok_or(addr)?;
        let a = self.allocations.get_mut(&base).ok_or(addr)?;
        let mut rest = data;
        while !rest.is_empty() {
            let page = off / PAGE;
            let in_page = (off % PAGE) as usize;
            let n = rest.len().min(PAGE as usize - in_page);
            let buf = a
                .pages
                .entry(page)
                .or_insert_with(|| vec![0; PAGE as usize].into_boxed_slice());
            buf[in_page..in_page + n].copy_from_slice(&rest[..n]);
            rest = &rest[n..];
            off += n as u64;
        }
        Ok(())
    }

    /// Copies from `addr` into `buf`; `Err(addr)` outside every allocation.
    pub fn read_bytes(&self, addr: u64, buf: &mut [u8]) -> Result<(), u64> {
        let (base, mut off) = self.find(addr, buf.len() as u64).ok_or(addr)?;
        let a = self.allocations.get(&base).ok_or(addr)?;
        let mut done = 0;
        while done < buf.len() {
            let page = off / PAGE;
            let in_page = (off % PAGE) as usize;
            let n = (buf.len() - done).min(PAGE as usize - in_page);
            match a.pages.get(&page) {
                Some(p) => buf[done..done + n].copy_from_slice(&p[in_page..in_page + n]),
                None => buf[done..done + n].fill(0),
            }
            done += n;
            off += n as u64;
        }
        Ok(())
    }
}

impl ptx::Memory for DeviceMemory {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), u64> {
        self.read_bytes(addr, buf)
    }

    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), u64> {
        self.write_bytes(addr, data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_cross_pages_and_stay_inside_their_allocation() {
        let mut m = DeviceMemory::new(0x7f00_0000_0000);
        let a = m.alloc(3 * PAGE);
        let b = m.alloc(10);
        assert!(b >= a + 3 * PAGE);
        let data: Vec<u8> = (0..PAGE as usize + 100).map(|i| i as u8).collect();
        m.write_bytes(a + PAGE - 50, &data).expect("write");
        let mut back = vec![0; data.len()];
        m.read_bytes(a + PAGE - 50, &mut back).expect("read");
        assert_eq!(back, data);
        let mut zero = [1u8; 8];
        m.read_bytes(a, &mut zero).expect("read untouched");
        assert_eq!(zero, [0; 8]);
        assert_eq!(m.write_bytes(b + 8, &[0; 4]), Err(b + 8));
        assert_eq!(m.read_bytes(a - 1, &mut [0; 1]), Err(a - 1));
        assert_eq!(m.used(), 3 * PAGE + 10);
        assert_eq!(m.free(a + 1), None);
        assert_eq!(m.free(a), Some(3 * PAGE));
        assert_eq!(m.used(), 10);
    }

    #[test]
    fn a_huge_allocation_costs_nothing_until_touched() {
        let mut m = DeviceMemory::new(1 << 40);
        let a = m.alloc(80 << 30);
        m.write_bytes(a + (79 << 30), &[7])
            .expect("write at the end");
        let mut b = [0];
        m.read_bytes(a + (79 << 30), &mut b).expect("read");
        assert_eq!(b, [7]);
    }
}
